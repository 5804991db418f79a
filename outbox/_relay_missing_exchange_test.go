package outbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// A relay whose confirmed publisher names an exchange that is not declared
// yet (the relay deployed before the topology, or a misspelt exchange):
// RabbitMQ closes the channel of each publish with 404 NOT_FOUND. That is a
// wait, as an unbound topic is: the row is never counted nor dead-lettered;
// but a visible one, logged as unroutable with the broker's reason (it was
// logged at INFO as back-pressure, which an operator never sees). Once the
// exchange is declared and bound, the row is delivered once.
func TestRelayRabbitMQRowWaitsVisiblyForAMissingExchange(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	exchange := testenv.UniqueName("not_declared_yet")
	pub, err := idemamqp.NewConfirmedPublisher(idemamqp.ConfirmedPublisherConfig{
		URL: testenv.AMQPURL(), Exchange: exchange, ConfirmTimeout: 5 * time.Second,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	queue := rb.queue("orders")
	id := b.writeEvent(t, queue)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	rec := &counts{}
	b.relay(t, pub, outbox.RelayConfig{MaxAttempts: 2, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Recorder: rec})

	warned := func() bool {
		for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
			if strings.Contains(e.Msg, "unroutable") && e.Fields["event_id"] == id && errors.Is(e.Err, idemamqp.ErrUnroutable) &&
				strings.Contains(e.Err.Error(), "NOT_FOUND") {
				return true
			}
		}
		return false
	}
	eventually(t, 60*time.Second, func() bool { return rec.failed.Load() >= 5 && warned() },
		"the row's publish to the missing exchange retried past MaxAttempts and logged as unroutable with NOT_FOUND")
	require.Zero(t, rec.dead.Load(), "a row waiting for its exchange is dead-lettered")
	require.Equal(t, 1, b.pending(t), "the row stays in the outbox")
	for _, e := range logger.Captured()[watermill.InfoLogLevel] {
		require.NotContains(t, e.Msg, "back-pressure", "a missing exchange is logged as back-pressure")
	}

	require.NoError(t, rb.ch.ExchangeDeclare(exchange, "direct", false, true, false, false, nil))
	t.Cleanup(func() { _ = rb.ch.ExchangeDelete(exchange, false, false) })
	require.NoError(t, rb.ch.QueueBind(queue, queue, exchange, false, nil))
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(queue)...); return len(got) >= 1 }, "the kept row delivered once its exchange exists")
	require.Equal(t, []string{id}, got)
	eventually(t, 10*time.Second, func() bool { return b.pending(t) == 0 }, "the delivered row leaves the outbox")
	require.Equal(t, []string(nil), rb.received(queue), "delivered once")
}
