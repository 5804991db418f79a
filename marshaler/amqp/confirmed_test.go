package amqp_test

import (
	"context"
	"errors"
	"net/url"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

func declare(t *testing.T) (*amqp091.Channel, string) {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable", testenv.AMQPURL())
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	q := testenv.UniqueName("poison_q")
	_, err = ch.QueueDeclare(q, true, false, false, false, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	return ch, q
}

func poisonMsg(t *testing.T) *message.Message {
	m, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-42"})
	require.NoError(t, err)
	m.Metadata.Set("reason_poisoned", "bad")
	return m
}

// A poison message is confirmed into its queue; one to a queue that does
// not exist comes back (mandatory + basic.return) as ErrUnroutable, never
// as success.
func TestConfirmedPublisherConfirmsAndReportsUnroutable(t *testing.T) {
	t.Parallel()
	ch, q := declare(t)
	p, err := amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{URL: testenv.AMQPURL()}, nil)
	require.NoError(t, err)
	defer p.Close()

	m := poisonMsg(t)
	require.NoError(t, p.Publish(q, m))
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	require.NoError(t, err)
	require.Equal(t, 1, st.Messages, "confirmed means stored")
	d, ok, err := ch.Get(q, true)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, m.UUID, d.MessageId)
	require.Equal(t, "bad", d.Headers["reason_poisoned"])

	missing := testenv.UniqueName("no_such_dlq")
	err = p.Publish(missing, poisonMsg(t))
	require.ErrorIs(t, err, amqp.ErrUnroutable, "a poison message routed to no queue is a failure")

	// The publisher recovers on the next call.
	require.NoError(t, p.Publish(q, poisonMsg(t)))
}

// The broker unreachable: Publish fails (no hang beyond the context), and
// succeeds again once it is back, on a new connection.
func TestConfirmedPublisherBrokerDownThenBack(t *testing.T) {
	t.Parallel()
	p, proxy, ch, q := throughProxy(t, amqp.ConfirmedPublisherConfig{ConfirmTimeout: 5 * time.Second})
	defer p.Close()
	require.NoError(t, p.Publish(q, poisonMsg(t)))

	proxy.Refuse(time.Hour)
	m := poisonMsg(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	m.SetContext(ctx)
	err := p.Publish(q, m)
	require.Error(t, err)
	require.False(t, errors.Is(err, amqp.ErrUnroutable))

	proxy.Restore()
	require.NoError(t, p.Publish(q, poisonMsg(t)))
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	require.NoError(t, err)
	require.Equal(t, 2, st.Messages)
}

func TestConfirmedPublisherConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{}, nil)
	require.ErrorContains(t, err, "ConfirmedPublisherConfig.URL")
	_, err = amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{URL: "amqp://x", ConfirmTimeout: -1}, nil)
	require.True(t, strings.Contains(err.Error(), "ConfirmTimeout"))
}

// A publish the broker refuses by closing the channel (an exchange that does
// not exist: 404 NOT_FOUND, e.g. the relay started before any consumer
// declared the events exchange, or a misspelt ConfirmedPublisherConfig.Exchange)
// fails with the broker's reason, not a bare "channel closed"; and the
// error does not call a publisher that is also the outbox relay's a poison
// publisher. It is ErrUnroutable, not back-pressure (ErrNotConfirmed): the
// relay keeps the row and warns, naming the reason, instead of an INFO line.
func TestConfirmedPublisherReportsTheBrokersReasonForAMissingExchange(t *testing.T) {
	t.Parallel()
	missing := testenv.UniqueName("no_such_exchange")
	p, err := amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{URL: testenv.AMQPURL(), Exchange: missing}, nil)
	require.NoError(t, err)
	defer p.Close()

	err = p.Publish("order.placed", poisonMsg(t))
	require.Error(t, err)
	require.ErrorIs(t, err, amqp.ErrUnroutable, "the row stays in the outbox, warned")
	require.NotErrorIs(t, err, amqp.ErrNotConfirmed, "a missing exchange is no back-pressure")
	var amqpErr *amqp091.Error
	require.True(t, errors.As(err, &amqpErr), "the broker's reason is lost: %v", err)
	require.Equal(t, amqp091.NotFound, amqpErr.Code)
	require.Contains(t, err.Error(), missing)
	require.NotContains(t, err.Error(), "poison", "the relay's publisher is no poison publisher")
}

// A message whose headers do not fit in one frame (RabbitMQ's frame_max,
// 128 KiB) makes the broker close with 501 FRAME_ERROR at every attempt: it
// is the message's refusal (the row's fault, dead-lettered by the relay:
// no BackPressure method), not ErrNotConfirmed (back-pressure, retried for
// ever), and it names the broker's reason.
func TestConfirmedPublisherRefusesHeadersLargerThanAFrame(t *testing.T) {
	t.Parallel()
	p, err := amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{URL: testenv.AMQPURL()}, nil)
	require.NoError(t, err)
	defer p.Close()

	m := poisonMsg(t)
	m.Metadata.Set("note", strings.Repeat("x", 256<<10))
	err = p.Publish(testenv.UniqueName("framemax"), m)
	require.Error(t, err)
	require.NotErrorIs(t, err, amqp.ErrNotConfirmed, "not back-pressure")
	var bp interface{ BackPressure() bool }
	require.False(t, errors.As(err, &bp) && bp.BackPressure(), "not back-pressure: %v", err)
	var amqpErr *amqp091.Error
	require.True(t, errors.As(err, &amqpErr), "the broker's reason is lost: %v", err)
	require.Equal(t, amqp091.FrameError, amqpErr.Code)
}

// A classic queue at x-max-length-bytes with x-overflow reject-publish
// nacks a message that would take it past its limit. When it holds nothing
// ready and still nacks the message, the message alone is over the limit:
// it can never fit, and Publish says so (not ErrNotConfirmed, no
// BackPressure method: the relay counts it against the row, naming the
// queue). When the queue holds something, the nack is back-pressure
// (ErrNotConfirmed), and the same message goes in once the queue drains.
func TestConfirmedPublisherTellsAMessageThatCanNeverFitItsQueueFromAFullQueue(t *testing.T) {
	t.Parallel()
	ch, _ := declare(t)
	q := testenv.UniqueName("limited")
	_, err := ch.QueueDeclare(q, false, false, false, false, amqp091.Table{"x-max-length-bytes": int64(1024), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = ch.QueueDelete(q, false, false, false) })
	p, err := amqp.NewConfirmedPublisher(amqp.ConfirmedPublisherConfig{URL: testenv.AMQPURL()}, nil)
	require.NoError(t, err)
	defer p.Close()
	var bp interface{ BackPressure() bool }

	big, err := marshaler.NewMessage("order.placed", map[string]string{"note": strings.Repeat("x", 2048)})
	require.NoError(t, err)
	err = p.Publish(q, big)
	require.Error(t, err)
	require.NotErrorIs(t, err, amqp.ErrNotConfirmed, "a message its empty queue refuses is not back-pressure")
	require.False(t, errors.As(err, &bp) && bp.BackPressure(), "not back-pressure: %v", err)
	require.ErrorContains(t, err, q)

	filler, err := marshaler.NewMessage("order.placed", map[string]string{"note": strings.Repeat("x", 800)}) // ~950 bytes: the queue is full for any other
	require.NoError(t, err)
	require.NoError(t, p.Publish(q, filler))
	small := poisonMsg(t)
	err = p.Publish(q, small)
	require.ErrorIs(t, err, amqp.ErrNotConfirmed, "a queue that holds something and nacks is full: back-pressure")
	require.True(t, errors.As(err, &bp) && bp.BackPressure())

	_, ok, err := ch.Get(q, true) // the consumer drains the queue
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, p.Publish(q, small), "it fits once the queue has room")
}

// A broker that stops answering (a hung TCP peer: no reset, no reply) must
// not hold a publish past its message's context: not in the dial and
// handshake (amqp091's own deadline is 30 s), not waiting for the confirm
// (ConfirmTimeout is an hour here), not waiting for the turn behind another
// hung publish, and not closing the broken connection. The poison path
// hands the message context to Publish; a router's shutdown ends it.
func TestConfirmedPublisherReturnsWhenItsContextEndsWhileTheBrokerHangs(t *testing.T) {
	t.Parallel()
	// A hang guard, not a measurement: far below the broker-side bounds a
	// publish that ignored its context would wait for.
	const guard = 20 * time.Second
	publish := func(p *amqp.ConfirmedPublisher, q string) (cancel func(), result <-chan error) {
		m := poisonMsg(t)
		ctx, cancel := context.WithCancel(context.Background())
		m.SetContext(ctx)
		done := make(chan error, 1)
		go func() { done <- p.Publish(q, m) }()
		return cancel, done
	}
	returned := func(what string, result <-chan error) {
		t.Helper()
		select {
		case err := <-result:
			require.ErrorIs(t, err, context.Canceled, what)
		case <-time.After(guard):
			t.Fatalf("%s: Publish still running %s after its context ended", what, guard)
		}
	}
	for _, connected := range []bool{false, true} {
		p, proxy, _, q := throughProxy(t, amqp.ConfirmedPublisherConfig{ConfirmTimeout: time.Hour})
		what := "the dial"
		if connected {
			require.NoError(t, p.Publish(q, poisonMsg(t)))
			what = "the confirm"
		}
		proxy.Hang()
		cancelFirst, first := publish(p, q)
		cancelSecond, second := publish(p, q) // waits for the first's turn
		time.Sleep(200 * time.Millisecond)    // lets both reach their waits (an ordering aid; the result does not depend on it)
		cancelSecond()
		returned(what+": the publish waiting for its turn", second)
		cancelFirst()
		returned(what, first)
		proxy.Resume()
		require.NoError(t, p.Close())
	}
}

// A message larger than the socket buffers, written while the broker stops
// reading (a memory or disk alarm, a stalled network), blocks in amqp091's
// write, which looks at the context only before it starts and holds the
// channel's lock, so not even amqp091's heartbeat timeout ends it (its
// shutdown waits for that lock). Publish closes the connection when its
// context ends, which fails the write, and Close is not held behind it.
func TestConfirmedPublisherLargeWriteToABrokerThatStoppedReadingEndsWithItsContext(t *testing.T) {
	p, proxy, _, q := throughProxy(t, amqp.ConfirmedPublisherConfig{ConfirmTimeout: time.Hour})
	require.NoError(t, p.Publish(q, poisonMsg(t))) // connected
	proxy.Hang()
	defer proxy.Resume()
	// A poison copy of a malformed body is published verbatim, whatever
	// its size.
	big := marshaler.NewMalformed([]byte(strings.Repeat("x", 15<<20)), "tag-1", "bad")
	ctx, cancel := context.WithCancel(context.Background())
	big.SetContext(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Publish(q, big) }()
	time.Sleep(500 * time.Millisecond) // lets the write fill the buffers (an ordering aid; the result does not depend on it)
	cancel()
	const guard = 60 * time.Second // a hang guard: beyond amqp091's heartbeat (3 × 10 s) and close (5 s) bounds
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(guard):
		t.Fatalf("Publish still blocked %s after its context ended (the broker stopped reading)", guard)
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(guard):
		t.Fatal("Close still blocked")
	}
}

// While the broker does not answer, each failed publish's dial goes on in
// the background; the next publish waits for that dial instead of starting
// another, so a retry loop during an outage keeps one pending connection,
// not one per retry.
func TestConfirmedPublisherKeepsOneDialPendingWhileTheBrokerHangs(t *testing.T) {
	p, proxy, _, q := throughProxy(t, amqp.ConfirmedPublisherConfig{})
	defer p.Close()
	require.NoError(t, p.Publish(q, poisonMsg(t))) // connected
	proxy.Hang()
	defer proxy.Resume()
	base := runtime.NumGoroutine()
	for i := 0; i < 100; i++ {
		m := poisonMsg(t)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		m.SetContext(ctx)
		require.Error(t, p.Publish(q, m))
		cancel()
	}
	require.Less(t, runtime.NumGoroutine()-base, 20, "a dial per failed publish is left pending")
}

// throughProxy returns a publisher with cfg whose broker is behind a fault
// proxy, the proxy, and a channel and a queue of the test's own.
func throughProxy(t *testing.T, cfg amqp.ConfirmedPublisherConfig) (*amqp.ConfirmedPublisher, *faultproxy.Proxy, *amqp091.Channel, string) {
	t.Helper()
	ch, q := declare(t)
	u, err := url.Parse(testenv.AMQPURL())
	require.NoError(t, err)
	proxy, err := faultproxy.Start(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	cfg.URL = u.String()
	p, err := amqp.NewConfirmedPublisher(cfg, nil)
	require.NoError(t, err)
	return p, proxy, ch, q
}
