package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// GoChannel is a documented transport (docs/transports.md: no delivery
// count, no redelivered flag). A handler that publishes to it
// synchronously (BlockPublishUntilSubscriberAck) waits for another
// consumer's handler of the same process. Both are counted attempts (the
// first 64 after a consumer starts, on a transport that marks nothing),
// though a process that dies loses GoChannel's messages and can redeliver
// none: the second waits for the counted turn its own publisher holds, the
// whole countedTurnWait (a minute) for every such message, and then runs
// "beside" it. A pipeline of two handlers stalls a minute per message
// for its first 64 messages. Here the wait is cut to 200ms; the log tells
// the wait happened (it always does: the holder waits for the waiter).
func TestSynchronousInProcessPublishNeverWaitsForTheCountedTurn(t *testing.T) {
	defer inbox.SetCountedTurnWait(200 * time.Millisecond)()
	e := newEnv(t)
	logger := &captureLogger{}
	newMW := func(consumer string) message.HandlerMiddleware {
		m, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
			Store:    e.store, Consumer: consumer,
			MaxCrashes: 3, CrashQuerier: sqldb.Pgx(e.pool),
		}, logger)
		require.NoError(t, err)
		return m.Middleware
	}
	bus := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer bus.Close()
	topic := "billing-" + uuid.NewString()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	in, err := bus.Subscribe(ctx, topic)
	require.NoError(t, err)

	billing := newMW("billing")(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeEffect(msg, "billed")
	})
	go func() {
		for msg := range in {
			if _, err := billing(msg); err == nil {
				msg.Ack()
			} else {
				msg.Nack()
			}
		}
	}()
	orders := newMW("orders")(func(msg *message.Message) ([]*message.Message, error) {
		out := newMsg(uuid.Must(uuid.NewV7()).String())
		if err := bus.Publish(topic, out); err != nil { // returns once billing acked
			return nil, err
		}
		return nil, writeEffect(msg, "ordered")
	})
	order := newMsg(uuid.Must(uuid.NewV7()).String()) // a first delivery on GoChannel
	_, err = orders(order)
	require.NoError(t, err)
	require.Equal(t, 1, e.effects(order.UUID))

	logger.mu.Lock()
	defer logger.mu.Unlock()
	for _, l := range logger.lines {
		require.False(t, strings.HasPrefix(l.msg, "Counted attempt runs beside"),
			"an in-process handler waited the whole counted-turn bound for the attempt that waits for it: %s", l.msg)
	}
}

// Two consumers' claims nested around one handler (allowed: only the same
// consumer nested is refused, wiredTwice) run one counted attempt of one
// delivery: the inner waits for the turn its own outer attempt holds, the
// whole countedTurnWait (a minute) for every redelivery, then runs
// "beside" itself.
func TestNestedConsumersOfOneDeliveryNeverWaitForTheirOwnTurn(t *testing.T) {
	defer inbox.SetCountedTurnWait(200 * time.Millisecond)()
	e := newEnv(t)
	logger := &captureLogger{}
	newMW := func(consumer string) message.HandlerMiddleware {
		m, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
			Store:    e.store, Consumer: consumer,
			MaxCrashes: 3, CrashQuerier: sqldb.Pgx(e.pool),
		}, logger)
		require.NoError(t, err)
		return m.Middleware
	}
	h := newMW("audit")(newMW("stock")(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeEffect(msg, "")
	}))
	msg := countedMsg(true) // a redelivery
	_, err := h(msg)
	require.NoError(t, err)
	require.Equal(t, 1, e.effects(msg.UUID))
	logger.mu.Lock()
	defer logger.mu.Unlock()
	for _, l := range logger.lines {
		require.False(t, strings.HasPrefix(l.msg, "Counted attempt runs beside"),
			"a nested claim waited the whole counted-turn bound for its own outer attempt: %s", l.msg)
	}
}
