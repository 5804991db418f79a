package metrics_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/metrics"
)

// TestStallReportIsNoAttemptDuration: a stall report (OutcomeStalled, the
// idle time as Total) is counted, but is no attempt: it adds no sample to
// attempt_duration_seconds, whose quantiles would show the idle minute as
// an attempt of "<no handler>".
func TestStallReportIsNoAttemptDuration(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	p, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	p.RecordOutcome(inbox.Observation{Consumer: "stock", Outcome: inbox.OutcomeStalled, Total: 90 * time.Second})
	require.Equal(t, 1, testutil.CollectAndCount(reg, "idempotency_attempts_total"), "the stall is counted")
	require.Equal(t, 0, testutil.CollectAndCount(reg, "idempotency_attempt_duration_seconds"), "the stall's idle time is no attempt's duration")
}
