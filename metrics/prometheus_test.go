package metrics_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/metrics"
	"github.com/watermill-idempotency/idempotency/middleware"
)

func TestPrometheusRecorder(t *testing.T) {
	t.Parallel()
	_, err := metrics.NewPrometheus(metrics.Config{})
	require.ErrorContains(t, err, "Config.Registerer")

	reg := prometheus.NewRegistry()
	p, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	_, err = metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.Error(t, err, "registering twice on one registry fails")

	p.RecordOutcome(middleware.Observation{Consumer: "stock", Outcome: middleware.OutcomeProcessed, Claim: time.Millisecond, Total: 3 * time.Millisecond})
	p.RecordOutcome(middleware.Observation{Consumer: "stock", Outcome: middleware.OutcomeDuplicate, Claim: time.Millisecond, Total: time.Millisecond})
	p.RecordOutcome(middleware.Observation{Consumer: "stock", Outcome: middleware.OutcomeRejected, Total: time.Microsecond})
	at := time.Unix(1_700_000_000, 0)
	p.RecordPurge(42, at)

	require.Equal(t, 3, testutil.CollectAndCount(reg, "idempotency_messages_total"))
	require.Equal(t, 1, testutil.CollectAndCount(reg, "idempotency_claim_duration_seconds"))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				got[mf.GetName()] += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				got[mf.GetName()] = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				got[mf.GetName()] += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	require.Equal(t, 3.0, got["idempotency_messages_total"])
	require.Equal(t, 2.0, got["idempotency_claim_duration_seconds"], "no claim sample for a rejected message")
	require.Equal(t, 3.0, got["idempotency_transaction_duration_seconds"])
	require.Equal(t, 42.0, got["idempotency_purged_rows_total"])
	require.Equal(t, 1_700_000_000.0, got["idempotency_last_purge_timestamp_seconds"])
}
