package metrics_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/metrics"
)

func gather(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func labelsOf(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, lp := range m.GetLabel() {
		out[lp.GetName()] = lp.GetValue()
	}
	return out
}

func TestPrometheusRecorder(t *testing.T) {
	t.Parallel()
	_, err := metrics.NewPrometheus(metrics.Config{})
	require.ErrorContains(t, err, "Config.Registerer")
	_, err = metrics.NewPrometheus(metrics.Config{Registerer: prometheus.NewRegistry(), Buckets: []float64{1, 1}})
	require.ErrorContains(t, err, "Config.Buckets")

	reg := prometheus.NewRegistry()
	p, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	_, err = metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.Error(t, err, "registering twice on one registry fails")

	p.RecordOutcome(inbox.Observation{Consumer: "stock", HandlerName: "stock_h", Outcome: inbox.OutcomeProcessed, Claim: time.Millisecond, Total: 3 * time.Millisecond})
	p.RecordOutcome(inbox.Observation{Consumer: "stock", HandlerName: "stock_h", Outcome: inbox.OutcomeDuplicate, Claim: time.Millisecond, Total: time.Millisecond})
	p.RecordOutcome(inbox.Observation{Consumer: "stock", HandlerName: "stock_h", Outcome: inbox.OutcomeDuplicate, Claim: time.Millisecond, Total: time.Millisecond})
	p.RecordOutcome(inbox.Observation{Consumer: "stock", Outcome: inbox.OutcomeRejected, Total: time.Microsecond})

	require.Equal(t, 3, testutil.CollectAndCount(reg, "idempotency_attempts_total"), "one series per consumer, handler, outcome")
	require.Equal(t, 1, testutil.CollectAndCount(reg, "idempotency_claim_duration_seconds"), "no claim series for the rejected message")
	mfs := gather(t, reg)
	var attempts float64
	byLabels := map[string]float64{}
	for _, m := range mfs["idempotency_attempts_total"].GetMetric() {
		l := labelsOf(m)
		attempts += m.GetCounter().GetValue()
		byLabels[l["consumer"]+"|"+l["handler_name"]+"|"+l["outcome"]] = m.GetCounter().GetValue()
	}
	require.Equal(t, 4.0, attempts, "every attempt counted, duplicates too")
	require.Equal(t, map[string]float64{
		"stock|stock_h|processed":                      1,
		"stock|stock_h|duplicate":                      2,
		"stock|" + metrics.NoHandlerName + "|rejected": 1,
	}, byLabels, "handler_name as Watermill's metrics label it, <no handler> outside a router")

	var claims uint64
	for _, m := range mfs["idempotency_claim_duration_seconds"].GetMetric() {
		claims += m.GetHistogram().GetSampleCount()
	}
	require.EqualValues(t, 3, claims, "no claim sample for a rejected message")
	var totals uint64
	for _, m := range mfs["idempotency_attempt_duration_seconds"].GetMetric() {
		totals += m.GetHistogram().GetSampleCount()
	}
	require.EqualValues(t, 4, totals)
	for name := range mfs {
		require.True(t, strings.HasPrefix(name, metrics.DefaultNamespace+"_"), name)
	}
}

// A claim of about 60 µs is resolved by the default buckets: it falls
// between two bounds below 100 µs, not in a first bucket that holds every
// claim (prometheus.DefBuckets start at 5 ms).
func TestDefaultBucketsResolveMicrosecondClaims(t *testing.T) {
	t.Parallel()
	b := metrics.DefaultBuckets()
	require.Len(t, b, 20)
	require.InDelta(t, 10e-6, b[0], 1e-12)
	require.Greater(t, b[len(b)-1], 5.0, "seconds-long attempts still resolved")

	reg := prometheus.NewRegistry()
	p, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	for _, d := range []time.Duration{20 * time.Microsecond, 60 * time.Microsecond, 65 * time.Microsecond, 5 * time.Millisecond} {
		p.RecordOutcome(inbox.Observation{Consumer: "c", Outcome: inbox.OutcomeProcessed, Claim: d, Total: d})
	}
	h := gather(t, reg)["idempotency_claim_duration_seconds"].GetMetric()[0].GetHistogram()
	var below40us, below80us, below100us uint64
	for _, bk := range h.GetBucket() {
		switch ub := bk.GetUpperBound(); {
		case ub <= 40e-6:
			below40us = bk.GetCumulativeCount()
		case ub <= 80e-6:
			below80us = bk.GetCumulativeCount()
		case ub <= 100e-6:
			below100us = bk.GetCumulativeCount()
		}
	}
	require.EqualValues(t, 1, below40us, "20 µs below the 40 µs bound")
	require.EqualValues(t, 3, below80us, "60 µs and 65 µs between the 40 µs and 80 µs bounds")
	require.LessOrEqual(t, below100us, uint64(3), "5 ms above 100 µs")
	require.Greater(t, h.GetBucket()[0].GetUpperBound(), 0.0)
	require.Less(t, h.GetBucket()[0].GetUpperBound(), 60e-6, "the first bucket does not swallow a 60 µs claim")
}

// Two purgers are two series: the table label.
func TestOnPurgeLabelsTheTable(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	p, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	processed, latest := p.OnPurge("processed_event"), p.OnPurge("latest_version")
	processed(42, time.Unix(1_700_000_000, 0))
	processed(8, time.Unix(1_700_000_060, 0))
	latest(5, time.Unix(1_700_000_030, 0))

	mfs := gather(t, reg)
	rows, last := map[string]float64{}, map[string]float64{}
	for _, m := range mfs["idempotency_purged_rows_total"].GetMetric() {
		rows[labelsOf(m)["table"]] = m.GetCounter().GetValue()
	}
	for _, m := range mfs["idempotency_last_purge_timestamp_seconds"].GetMetric() {
		last[labelsOf(m)["table"]] = m.GetGauge().GetValue()
	}
	require.Equal(t, map[string]float64{"processed_event": 50, "latest_version": 5}, rows)
	require.Equal(t, map[string]float64{"processed_event": 1_700_000_060, "latest_version": 1_700_000_030}, last)
}
