package outboxprom_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/outbox/outboxprom"
)

func TestRecorder(t *testing.T) {
	t.Parallel()
	_, err := outboxprom.New(outboxprom.Config{})
	require.ErrorContains(t, err, "Config.Registerer")
	reg := prometheus.NewRegistry()
	_, err = outboxprom.New(outboxprom.Config{Registerer: reg})
	require.ErrorContains(t, err, "Config.Outbox")
	r, err := outboxprom.New(outboxprom.Config{Registerer: reg, Outbox: "orders"})
	require.NoError(t, err)
	r.Round(3)
	r.Round(0)
	r.PublishFailed("a")
	r.PublishFailed("a")
	r.DeadLettered("a")
	r.Pending(7, 1500*time.Millisecond)
	want := `
# HELP idempotency_outbox_dead_lettered_total Outbox rows moved to the dead-letter table, by destination topic.
# TYPE idempotency_outbox_dead_lettered_total counter
idempotency_outbox_dead_lettered_total{outbox="orders",topic="a"} 1
# HELP idempotency_outbox_oldest_pending_age_seconds Age of the oldest pending outbox row (0 when none).
# TYPE idempotency_outbox_oldest_pending_age_seconds gauge
idempotency_outbox_oldest_pending_age_seconds{outbox="orders"} 1.5
# HELP idempotency_outbox_pending_rows Outbox rows committed and not yet relayed.
# TYPE idempotency_outbox_pending_rows gauge
idempotency_outbox_pending_rows{outbox="orders"} 7
# HELP idempotency_outbox_publish_failures_total Failed publishes of outbox rows, by destination topic.
# TYPE idempotency_outbox_publish_failures_total counter
idempotency_outbox_publish_failures_total{outbox="orders",topic="a"} 2
# HELP idempotency_outbox_relay_rounds_total Committed relay rounds (claim transactions).
# TYPE idempotency_outbox_relay_rounds_total counter
idempotency_outbox_relay_rounds_total{outbox="orders"} 2
# HELP idempotency_outbox_relayed_total Outbox rows published and removed.
# TYPE idempotency_outbox_relayed_total counter
idempotency_outbox_relayed_total{outbox="orders"} 3
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want)))
}
