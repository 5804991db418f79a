package middleware_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// A handler subscribed to its consumer's own poison topic would receive its
// own dead letters (a message that fails there goes round for ever): both
// AddConsumerHandler and AddHandler refuse it, naming the topic, and the
// refused attach leaves the consumer free to serve another handler.
func TestAddConsumerHandlerRefusesToConsumeItsOwnPoisonTopic(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	cfg := e.config("stock")
	cfg.Poison.Topic = "stock.dead_letters"
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)

	_, err = c.AddConsumerHandler(r, "reserve", "stock.dead_letters", e.pubsub, func(*message.Message) error { return nil })
	require.Error(t, err)
	require.ErrorContains(t, err, `"stock.dead_letters"`)
	require.ErrorContains(t, err, "Poison.Topic")

	_, err = c.AddHandler(r, "reserve", "stock.dead_letters", e.pubsub, "out", e.pubsub,
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	require.ErrorContains(t, err, `"stock.dead_letters"`)

	_, err = c.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(*message.Message) error { return nil })
	require.NoError(t, err, "the refused attach did not use the consumer up")
}
