package middleware_test

import (
	"testing"
	"time"

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

// An empty subscribe topic is refused, naming the handler (a RabbitMQ
// subscriber bound its queue with routing key "" and received nothing,
// while the consumer looked healthy), and the refused attach leaves the
// consumer free to serve the handler on its real topic.
func TestAddConsumerHandlerRefusesAnEmptySubscribeTopic(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	c, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)

	_, err = c.AddConsumerHandler(r, "reserve", "", e.pubsub, func(*message.Message) error { return nil })
	require.ErrorContains(t, err, "empty subscribe topic")
	require.ErrorContains(t, err, `"reserve"`)
	_, err = c.AddHandler(r, "reserve", "", e.pubsub, "out", e.pubsub,
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	require.ErrorContains(t, err, "empty subscribe topic")

	_, err = c.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(*message.Message) error { return nil })
	require.NoError(t, err, "the refused attach did not use the consumer up")
}

// NewConsumer on a table that was never migrated names ConsumerConfig.Table
// and says to run processed.Migrate (it named ReplayHorizon, even when
// ReplayHorizon was 0); a horizon that differs from the table's still names
// ReplayHorizon.
func TestNewConsumerOnAnUnmigratedTableNamesTheTable(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	cfg := e.config("stock")
	cfg.Table = "never_migrated"
	_, err := middleware.NewConsumer(cfg, nil)
	require.ErrorContains(t, err, "ConsumerConfig.Table")
	require.ErrorContains(t, err, "never_migrated")
	require.ErrorContains(t, err, "processed.Migrate")
	require.NotContains(t, err.Error(), "ReplayHorizon")

	cfg = e.config("stock")
	cfg.ReplayHorizon = time.Hour
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	cfg.ReplayHorizon = 2 * time.Hour
	_, err = middleware.NewConsumer(cfg, nil)
	require.ErrorContains(t, err, "ConsumerConfig.ReplayHorizon")
}
