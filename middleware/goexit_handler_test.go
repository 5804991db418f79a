package middleware_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// TestHandlerEndingItsGoroutineIsDeadLetteredAndTheSubscriptionGoesOn: a
// handler that calls runtime.Goexit (t.FailNow, a require assertion in a
// handler) after writing its effect. The attempt is rolled back, the
// delivery is dead-lettered once as a permanent failure and acked, and the
// next message of the subscription is applied. On the old code the
// delivery was neither acked nor nacked (Watermill's router acks only what
// its handler returns): the subscription stopped for good and nothing was
// logged or dead-lettered.
func TestHandlerEndingItsGoroutineIsDeadLetteredAndTheSubscriptionGoesOn(t *testing.T) {
	env := newConsumerEnv(t)
	ctx := context.Background()
	c, err := middleware.NewConsumer(env.config("stock"), watermill.NopLogger{})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	exiting, next := newEvent(t), newEvent(t)
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", env.pubsub, func(msg *message.Message) error {
		calls.Add(1)
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'x')`, msg.UUID); err != nil {
			return err
		}
		if msg.UUID == exiting.UUID {
			runtime.Goexit()
		}
		return nil
	})
	require.NoError(t, err)
	dl, err := env.pubsub.Subscribe(ctx, "poison")
	require.NoError(t, err)
	runRouter(t, r)
	require.NoError(t, env.pubsub.Publish("orders", exiting, next))

	select {
	case d := <-dl:
		require.Equal(t, exiting.UUID, d.UUID)
		require.Contains(t, d.Metadata.Get("reason_poisoned"), "runtime.Goexit")
		d.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the delivery whose handler called runtime.Goexit was not dead-lettered")
	}
	require.Eventually(t, func() bool { return env.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond,
		"the next message is applied: the subscription goes on")
	var n int
	require.NoError(t, env.pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, exiting.UUID).Scan(&n))
	require.Zero(t, n, "the exiting attempt's effect was rolled back")
	require.EqualValues(t, 2, calls.Load(), "the handler ran once for each message")
}
