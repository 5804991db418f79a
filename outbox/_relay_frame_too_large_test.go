package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// A row whose metadata does not fit in one AMQP frame (256 KiB of headers,
// frame_max 128 KiB) can never be published: RabbitMQ closes the channel
// with 501 FRAME_ERROR frame_too_large at every attempt. The broker takes
// everything else (the probe, a bound queue), so per producer.md ("A bad
// row does not wedge it") the row is the row's fault: dead-lettered after
// MaxAttempts, and the row behind it in its topic is delivered.
// ConfirmedPublisher reports the closed channel as ErrNotConfirmed, which
// is back-pressure: the row is retried forever, counted against nothing,
// and holds its topic back for good (its oversize-payload sibling, 17 MiB
// over max_message_size, is dead-lettered as it should be).
//
// With no queue bound to the probe topic (the README's wiring) the same
// holds: the probe's unroutable return is the broker's answer, so the
// broker is up; it used to count as a failed probe, the row's failures
// as an outage, and the row wedged its topic for ever.
func TestRelayRabbitMQRowTooLargeForAFrameDoesNotWedgeItsTopic(t *testing.T) {
	t.Parallel()
	for _, probe := range []string{"bound", "unbound"} {
		t.Run("probe topic "+probe, func(t *testing.T) {
			t.Parallel()
			rowTooLargeForAFrame(t, probe == "bound")
		})
	}
}

func rowTooLargeForAFrame(t *testing.T, bindProbe bool) {
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	probeQ, q := testenv.UniqueName("outbox_probe_unbound"), rb.queue("framemax")
	if bindProbe {
		probeQ = rb.queue("probe")
	}
	m, err := marshaler.NewMessage("order.placed", map[string]string{"k": "v"})
	require.NoError(t, err)
	m.Metadata.Set("note", strings.Repeat("x", 256<<10))
	tx, pub := b.begin(t)
	require.NoError(t, pub.Publish(q, m))
	require.NoError(t, tx.Commit())
	next := b.writeEvent(t, q)
	rec := &counts{}
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: 3, RetryInterval: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	var got []string
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && !(rec.dead.Load() == 1 && len(got) == 1) {
		got = append(got, rb.received(q)...)
		time.Sleep(50 * time.Millisecond)
	}
	var lastErr string
	_ = b.tg.DB.QueryRow(context.Background(), `SELECT coalesce(last_error, '') FROM `+b.tg.Quote(b.table)+` ORDER BY id LIMIT 1`).Scan(&lastErr)
	t.Logf("failed %d, pressured %d, dead %d, pending %d, got %d, last error %.300q", rec.failed.Load(), rec.pressure.Load(), rec.dead.Load(), b.pending(t), len(got), lastErr)
	require.Equal(t, int64(1), rec.dead.Load(), "the row that can never be published is dead-lettered")
	require.Equal(t, []string{next}, got, "the row behind it in its topic is delivered")
}
