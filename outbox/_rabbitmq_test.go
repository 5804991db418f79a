package outbox_test

import (
	"context"
	"errors"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// rabbit is a RabbitMQ destination for a relay, reached through a fault
// proxy: a confirmed, mandatory publisher on the default exchange (topic =
// queue name), so a row for a topic with no queue is refused by the broker
// (basic.return, idemamqp.ErrUnroutable) while the broker is up.
type rabbit struct {
	t     *testing.T
	proxy *faultproxy.Proxy
	ch    *amqp091.Channel // direct, not through the proxy
	pub   *idemamqp.ConfirmedPublisher
}

func newRabbit(t *testing.T) *rabbit {
	t.Helper()
	u, err := url.Parse(testenv.AMQPURL())
	require.NoError(t, err)
	conn, err := amqp091.Dial(u.String())
	require.NoError(t, err, "RabbitMQ at %s", u.Host)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	proxy, err := faultproxy.Start(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	pub, err := idemamqp.NewConfirmedPublisher(idemamqp.ConfirmedPublisherConfig{URL: u.String(), ConfirmTimeout: 5 * time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return &rabbit{t: t, proxy: proxy, ch: ch, pub: pub}
}

// queue declares a queue of its own (deleted at the end) and returns its
// name: a routable topic.
func (r *rabbit) queue(prefix string) string {
	r.t.Helper()
	q, err := r.ch.QueueDeclare(testenv.UniqueName(prefix), false, false, false, false, nil)
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _, _ = r.ch.QueueDelete(q.Name, false, false, false) })
	return q.Name
}

// received returns the event ids waiting in queue, in order (consumed).
func (r *rabbit) received(queue string) []string {
	r.t.Helper()
	var ids []string
	for {
		d, ok, err := r.ch.Get(queue, true)
		require.NoError(r.t, err)
		if !ok {
			return ids
		}
		ids = append(ids, d.MessageId)
	}
}

// writeEvent commits one outbox row holding a valid envelope for topic.
func (b *box) writeEvent(t *testing.T, topic string) string {
	t.Helper()
	m, err := marshaler.NewMessage("order.placed", map[string]string{"k": "v"})
	require.NoError(t, err)
	tx, pub := b.begin(t)
	require.NoError(t, pub.Publish(topic, m))
	require.NoError(t, tx.Commit())
	return m.UUID
}

// TestRelayRabbitMQ: who is at fault when a publish fails, with RabbitMQ,
// on every database.
func TestRelayRabbitMQ(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		t.Run("LoneUnroutableRowKept", func(t *testing.T) { testLoneUnroutableRowKept(t, newBox(t, tg)) })
		t.Run("OutageThroughProxyDeadLettersNothing", func(t *testing.T) { testProxyOutage(t, newBox(t, tg)) })
		t.Run("FullQueueDeadLettersNothing", func(t *testing.T) { testFullQueue(t, newBox(t, tg)) })
		t.Run("BlockedConnectionBounded", func(t *testing.T) { testBlockedConnection(t, newBox(t, tg)) })
		t.Run("RowsBeforeTheirQueueExistsAreKept", func(t *testing.T) { testRowsBeforeQueue(t, newBox(t, tg)) })
	})
}

// One row the broker refuses as unroutable (mandatory publish to a topic
// no queue is bound to: its consumer is not deployed yet, or the topic is
// misspelt), alone in the outbox, the probe topic bound: the row is never
// counted nor dead-lettered however often it is retried; it stays in the
// outbox, each failure logged (ERROR here, WARN for a logger with Warn)
// naming its topic; a row of another topic written meanwhile is delivered,
// and the kept row is delivered once a queue is bound to its topic.
func testLoneUnroutableRowKept(t *testing.T, b *box) {
	rb := newRabbit(t)
	probeQ, goodQ := rb.queue("probe"), rb.queue("good")
	unroutable := testenv.UniqueName("nobody")
	bad := b.writeEvent(t, unroutable)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	rec := &counts{}
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: 3, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	eventually(t, 60*time.Second, func() bool { return rec.failed.Load() >= 6 }, "the unroutable row retried past MaxAttempts")
	require.Zero(t, rec.dead.Load(), "an unroutable row is never dead-lettered")
	require.Equal(t, 1, b.pending(t), "the row stays in the outbox")
	var logged bool
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(e.Msg, "unroutable") && e.Fields["topic"] == unroutable && e.Fields["event_id"] == bad && errors.Is(e.Err, idemamqp.ErrUnroutable) {
			logged = true
		}
	}
	require.True(t, logged, "logged with the topic, the event id and the reason")

	good := b.writeEvent(t, goodQ)
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(goodQ)...); return len(got) == 1 }, "the other topic flows")
	require.Equal(t, []string{good}, got)

	_, err = rb.ch.QueueDeclare(unroutable, false, false, false, false, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = rb.ch.QueueDelete(unroutable, false, false, false) })
	got = nil
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(unroutable)...); return len(got) >= 1 }, "the kept row delivered once its queue exists")
	require.Equal(t, []string{bad}, got)
	require.Zero(t, rec.dead.Load())
}

// RabbitMQ unreachable (the proxy refuses connections) for longer than
// MaxAttempts attempts of each topic's head row: nothing is dead-lettered,
// neither the good rows nor an unroutable one; once the broker is back the
// good rows are delivered in order, and the unroutable row stays in the
// outbox (no queue bound to its topic), still not dead-lettered.
func testProxyOutage(t *testing.T, b *box) {
	rb := newRabbit(t)
	probeQ, goodQ := rb.queue("probe"), rb.queue("good")
	rb.proxy.Refuse(time.Hour)
	ids := []string{b.writeEvent(t, goodQ), b.writeEvent(t, goodQ), b.writeEvent(t, goodQ)}
	bad := b.writeEvent(t, testenv.UniqueName("nobody"))
	rec := &counts{}
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	const maxAttempts = 2
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: maxAttempts, RetryInterval: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	eventually(t, 60*time.Second, func() bool { return rec.failed.Load() >= 6*maxAttempts }, "the head row of each topic failed well past MaxAttempts during the outage")
	require.Zero(t, rec.dead.Load(), "an outage dead-letters nothing")
	require.Equal(t, 4, b.pending(t))
	var counted int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+b.tg.Quote(b.table)+` WHERE attempts > 0`).Scan(&counted))
	require.Zero(t, counted, "failures during the outage are not the rows' attempts")
	var probeFailed bool
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		probeFailed = probeFailed || strings.Contains(e.Msg, "broker probe failed")
	}
	require.True(t, probeFailed, "the failed probe is logged")

	rb.proxy.Restore()
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(goodQ)...); return len(got) >= 3 }, "delivered after the outage")
	require.Equal(t, ids, got, "in order, once each")
	failed := rec.failed.Load()
	eventually(t, 60*time.Second, func() bool { return rec.failed.Load() >= failed+3*maxAttempts }, "the unroutable row retried with the broker up")
	require.Zero(t, rec.dead.Load(), "the unroutable row is not dead-lettered")
	var id string
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT event_id FROM `+b.tg.Quote(b.table)).Scan(&id))
	require.Equal(t, bad, id, "only the unroutable row is left")
	_ = message.NewMessage
}

// A destination queue at its length limit that refuses more
// (x-max-length 1, x-overflow reject-publish: the broker nacks) while its
// consumer is down, for many more rounds than MaxAttempts, with the broker
// up (the probe goes through): back-pressure, so no row is dead-lettered
// and none has an attempt counted; once the consumer drains the queue,
// every row arrives, in order.
func testFullQueue(t *testing.T, b *box) {
	rb := newRabbit(t)
	probeQ := rb.queue("probe")
	full := testenv.UniqueName("full")
	_, err := rb.ch.QueueDeclare(full, false, false, false, false, amqp091.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = rb.ch.QueueDelete(full, false, false, false) })
	ids := []string{b.writeEvent(t, full), b.writeEvent(t, full), b.writeEvent(t, full), b.writeEvent(t, full)}
	rec := &counts{}
	const maxAttempts = 2
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: maxAttempts, RetryInterval: 5 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	eventually(t, 60*time.Second, func() bool { return rec.pressure.Load() >= 5*maxAttempts }, "the full queue pushed back many times")
	require.Zero(t, rec.dead.Load(), "a full queue dead-letters nothing")
	var counted int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+b.tg.Quote(b.table)+` WHERE attempts > 0`).Scan(&counted))
	require.Zero(t, counted, "the nacks are not the rows' attempts")
	require.Equal(t, 3, b.pending(t), "one row in the queue, three waiting")

	var got []string // the consumer comes back
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(full)...); return len(got) >= len(ids) }, "all delivered once the queue drains")
	require.Equal(t, ids, got, "in order, once each")
	require.Zero(t, rec.dead.Load())
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
}

// The broker stops reading the relay's connection (modelled by the proxy
// holding every byte: a blocked connection, a memory or disk alarm, looks
// the same to the client): each publish is bounded by PublishTimeout,
// logged, counted as back-pressure, never against the row, and the stall
// is logged within StalledAfter with no transaction open; when the broker
// reads again the rows are delivered in order.
func testBlockedConnection(t *testing.T, b *box) {
	rb := newRabbit(t)
	probeQ, q := rb.queue("probe"), rb.queue("blocked")
	warm := b.writeEvent(t, q)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	db, activity := relayDB(t, b)
	rbox := &box{table: b.table, tg: b.tg, ob: ob, db: db}
	rec := &counts{}
	const timeout, stalledAfter = 500 * time.Millisecond, time.Second
	rbox.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: 1, PublishTimeout: timeout, StalledAfter: stalledAfter, StatsInterval: 20 * time.Millisecond,
		RetryInterval: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(q)...); return len(got) == 1 }, "the connection works")

	rb.proxy.Hang()
	start := time.Now()
	ids := []string{b.writeEvent(t, q), b.writeEvent(t, q)}
	var stalledAt time.Duration
	for time.Since(start) < stalledAfter+2*time.Second {
		if activity != nil {
			require.Zero(t, activity.openTx(t), "no transaction open while the broker is blocked")
		}
		if stalledAt == 0 {
			for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
				if errors.Is(e.Err, outbox.ErrStalled) {
					stalledAt = time.Since(start)
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	var timedOut bool
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		timedOut = timedOut || errors.Is(e.Err, outbox.ErrPublishTimeout)
	}
	require.True(t, timedOut, "the publish was bounded and logged")
	require.NotZero(t, stalledAt, "stall logged")
	require.Less(t, stalledAt, stalledAfter+500*time.Millisecond, "within StalledAfter (+ a stats interval)")
	require.GreaterOrEqual(t, rec.pressure.Load(), int64(1))
	require.Zero(t, rec.dead.Load(), "MaxAttempts 1, and nothing dead-lettered")
	t.Logf("stall logged %s after the broker blocked (StalledAfter %s)", stalledAt.Round(time.Millisecond), stalledAfter)

	rb.proxy.Resume()
	// At least once: a publish the broker read only after the relay gave
	// up on it (held by the proxy, then forwarded) arrives beside its retry.
	eventually(t, 90*time.Second, func() bool {
		got = append(got, rb.received(q)...)
		return b.pending(t) == 0 && slices.Contains(got, ids[0]) && slices.Contains(got, ids[1])
	}, "delivered once the broker reads again")
	require.Equal(t, warm, got[0])
	require.Subset(t, got[1:], ids)
	require.Zero(t, rec.dead.Load())
}

// A producer that runs before any consumer has declared its queue (the
// README's quick start on a fresh broker): with the confirmed, mandatory
// publisher and the default probe topic (bound to nothing), every publish
// comes back unroutable, which the relay never counts against a row: the
// rows stay in the outbox, none is dead-lettered, and once the queue
// exists they are delivered in order. With
// watermill-amqp's own publisher the broker drops them and the relay
// deletes them (seen by a new user: outbox 0 rows, consumer never called).
func testRowsBeforeQueue(t *testing.T, b *box) {
	rb := newRabbit(t)
	topic := testenv.UniqueName("later")
	var want []string
	for i := 0; i < 3; i++ {
		want = append(want, b.writeEvent(t, topic))
	}
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, newTestLogger())
	require.NoError(t, err)
	b.ob = ob
	rec := &counts{}
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: 2, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Recorder: rec})
	eventually(t, 60*time.Second, func() bool { return rec.failed.Load() >= 6 }, "publishes refused while no queue is bound")
	require.Zero(t, rec.dead.Load(), "nothing dead-lettered while the broker routes nothing")
	require.Equal(t, 3, b.pending(t), "every row kept")

	_, err = rb.ch.QueueDeclare(topic, false, false, false, false, nil) // the default exchange routes the topic to it
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = rb.ch.QueueDelete(topic, false, false, false) })
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(topic)...); return len(got) >= 3 }, "the rows delivered once the queue exists")
	require.Equal(t, want, got)
	require.Zero(t, rec.dead.Load())
}
