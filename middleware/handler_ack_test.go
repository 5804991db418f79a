package middleware_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A handler that acks the delivery itself (msg.Ack(), the idiom of a plain
// Watermill subscriber loop) and then fails its attempt: the claim and the
// effect roll back, so the event must still be applied (by the consumer's
// in-process retry, or by a redelivery), or at least reach the poison topic.
// Instead the ack reaches the subscriber at once, which ends the message's
// context (watermill-amqp and GoChannel both do), the chain takes the ended
// context for a shutdown and gives the message back with a nack that is a
// no-op after the ack: no retry, no poison, no redelivery. The effect is
// lost and nothing but "Handler returned error" is logged.
func TestHandlerThatAcksThenFailsLosesNoEffect(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	poison := &poisonLog{}
	cfg := e.config("stock")
	cfg.Poison.Publisher = poison
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", ps, func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			msg.Ack()
			return errors.New("first attempt fails after acking its delivery")
		}
		return nil
	})
	require.NoError(t, err)
	runRouter(t, r)

	msg := newEvent(t)
	require.NoError(t, ps.Publish("orders", msg))
	testenv.Eventually(t, 10*time.Second, "the event applied once (or dead-lettered)", func(o *testenv.Observed) bool {
		testenv.See(o, "handler calls", calls.Load())
		return testenv.See(o, "effects", e.effects(t))+testenv.See(o, "poisoned", len(poison.poisoned())) == 1
	})
}
