package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// byteLimitedQueue declares a classic queue of its own (deleted at the
// end) that holds at most limit bytes of message bodies and nacks a
// publish past that (x-overflow reject-publish), and returns its name.
func (r *rabbit) byteLimitedQueue(prefix string, limit int) string {
	r.t.Helper()
	q := testenv.UniqueName(prefix)
	_, err := r.ch.QueueDeclare(q, false, false, false, false, amqp091.Table{"x-max-length-bytes": int64(limit), "x-overflow": "reject-publish"})
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _, _ = r.ch.QueueDelete(q, false, false, false) })
	return q
}

// writeSized commits one outbox row for topic whose payload is size bytes
// of JSON, and returns its event id.
func (b *box) writeSized(t *testing.T, topic string, size int) string {
	t.Helper()
	m, err := marshaler.NewMessage("order.placed", map[string]string{"note": strings.Repeat("x", size)})
	require.NoError(t, err)
	tx, pub := b.begin(t)
	require.NoError(t, pub.Publish(topic, m))
	require.NoError(t, tx.Commit())
	return m.UUID
}

// A row larger than its queue's x-max-length-bytes (x-overflow
// reject-publish) is nacked at every attempt, also by the queue when it
// holds nothing: it can never fit, so it is not back-pressure (producer.md:
// "A bad row does not wedge it"). With the probe going through, it is the
// row's fault: dead-lettered after MaxAttempts, counted and logged at ERROR
// with its reason, and the row behind it in its topic is delivered.
func TestRelayRowLargerThanItsQueueCanEverHoldIsDeadLetteredAndItsTopicGoesOn(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	probeQ, q := rb.queue("probe"), rb.byteLimitedQueue("limited", 1024)
	big := b.writeSized(t, q, 2048)
	next := b.writeEvent(t, q)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	rec := &counts{}
	const maxAttempts = 3
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: maxAttempts, RetryInterval: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	var got []string
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && !(rec.dead.Load() == 1 && len(got) == 1) {
		got = append(got, rb.received(q)...)
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("failed %d, back-pressured %d, dead %d, pending %d, delivered %d", rec.failed.Load(), rec.pressure.Load(), rec.dead.Load(), b.pending(t), len(got))
	require.Equal(t, int64(1), rec.dead.Load(), "the row that can never fit its queue is dead-lettered")
	require.Equal(t, []string{next}, got, "the row behind it in its topic is delivered")

	var id, reason string
	var attempts int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT event_id, attempts, reason FROM `+b.tg.Quote(b.table+"_dead")).Scan(&id, &attempts, &reason))
	require.Equal(t, big, id)
	require.Equal(t, maxAttempts, attempts, "dead-lettered after MaxAttempts, as a row the broker refuses")
	require.Contains(t, reason, q, "the reason names the queue")
	var logged bool
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		logged = logged || (e.Msg == "outbox row dead-lettered" && e.Fields["event_id"] == big && e.Err != nil)
	}
	require.True(t, logged, "logged at ERROR with its event id and reason")
}

// A queue at its x-max-length-bytes (reject-publish) because its consumer
// is down nacks rows that would fit it once drained: back-pressure, for
// many more rounds than MaxAttempts, so no row is dead-lettered nor has an
// attempt counted; once the consumer drains the queue, every row arrives,
// in order. (The same limit as the row that can never fit above: what
// tells them apart is whether the queue holds anything.)
func TestRelayFullQueueStaysBackPressure(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	probeQ, q := rb.queue("probe"), rb.byteLimitedQueue("full", 4096)
	// The queue is full: 4000 bytes ready, no row of ~300 bytes fits.
	require.NoError(t, rb.ch.PublishWithContext(context.Background(), "", q, true, false, amqp091.Publishing{Body: make([]byte, 4000)}))
	testenv.Eventually(t, 10*time.Second, "the filler is in the queue", func(o *testenv.Observed) bool {
		st, err := rb.ch.QueueDeclarePassive(q, false, false, false, false, nil)
		require.NoError(t, err)
		return o.Int("ready", st.Messages) == 1
	})
	ids := []string{b.writeEvent(t, q), b.writeEvent(t, q), b.writeEvent(t, q)}
	rec := &counts{}
	const maxAttempts = 2
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: maxAttempts, RetryInterval: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	eventually(t, 60*time.Second, func() bool { return rec.pressure.Load() >= 5*maxAttempts }, "the full queue pushed back many times")
	require.Zero(t, rec.dead.Load(), "a full queue dead-letters nothing")
	var counted int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+b.tg.Quote(b.table)+` WHERE attempts > 0`).Scan(&counted))
	require.Zero(t, counted, "the nacks are not the rows' attempts")
	require.Equal(t, 3, b.pending(t), "every row waits")

	d, ok, err := rb.ch.Get(q, true) // the consumer comes back
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, d.MessageId, "the filler first")
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(q)...); return len(got) >= len(ids) }, "all delivered once the queue drains")
	require.Equal(t, ids, got, "in order, once each")
	require.Zero(t, rec.dead.Load())
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
}
