package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// ReplayHorizon 0 on a table that keeps none: the consumer refuses nothing
// (an event a month old is applied) and the table is not purged. A later
// consumer with 7 days records them; the purge waits HorizonChangeGrace
// (the consumer started at 0 refuses nothing until restarted); a consumer
// started at 0 now adopts 7 days and refuses the month-old event; another
// horizon is still refused.
func TestConsumerHorizonZeroOnATableThatKeepsNone(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	week := 7 * 24 * time.Hour
	purger, err := processed.NewPurger(processed.PurgerConfig{DB: e.db}, nil)
	require.NoError(t, err)

	unbounded, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	_, ran, err := purger.PurgeNow(ctx)
	require.NoError(t, err)
	require.False(t, ran, "a table that keeps none is never purged")

	cfg := e.config("mail")
	cfg.ReplayHorizon = week
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	got, err := processed.ReplayHorizon(ctx, e.db, "")
	require.NoError(t, err)
	require.Equal(t, week, got)
	_, ran, err = purger.PurgeNow(ctx)
	require.NoError(t, err)
	require.False(t, ran, "recorded on a table that kept none: the purge waits HorizonChangeGrace")

	adopted, err := middleware.NewConsumer(e.config("shipping"), nil)
	require.NoError(t, err, "0 adopts the recorded horizon")
	cfg = e.config("billing")
	cfg.ReplayHorizon = 2 * week
	_, err = middleware.NewConsumer(cfg, nil)
	require.ErrorIs(t, err, processed.ErrHorizonMismatch)

	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	var unboundedCalls, adoptedCalls atomic.Int32
	_, err = unbounded.AddConsumerHandler(r, "reserve", "orders.stock", e.pubsub, func(*message.Message) error {
		unboundedCalls.Add(1)
		return nil
	})
	require.NoError(t, err)
	_, err = adopted.AddConsumerHandler(r, "ship", "orders.shipping", e.pubsub, func(*message.Message) error {
		adoptedCalls.Add(1)
		return nil
	})
	require.NoError(t, err)
	poisoned, err := e.pubsub.Subscribe(ctx, "poison")
	require.NoError(t, err)
	runRouter(t, r)

	at := time.Now().Add(-30 * 24 * time.Hour)
	id := uuidV7At(t, at)
	for _, topic := range []string{"orders.stock", "orders.shipping"} {
		msg, err := marshaler.NewMessageWithID(id, "order.placed", at, map[string]string{"order_id": "o-1"})
		require.NoError(t, err)
		require.NoError(t, e.pubsub.Publish(topic, msg))
	}
	select {
	case p := <-poisoned:
		p.Ack()
		require.Equal(t, id.String(), p.UUID)
		require.Equal(t, "orders.shipping", p.Metadata.Get("topic_poisoned"), "the adopted horizon refuses it as expired")
	case <-time.After(10 * time.Second):
		t.Fatal("the expired event was not poisoned")
	}
	require.Eventually(t, func() bool { return unboundedCalls.Load() == 1 }, 10*time.Second, 10*time.Millisecond,
		"the consumer started on a table that kept none refuses nothing")
	require.Zero(t, adoptedCalls.Load())
}
