package middleware_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// ConsumerConfig.OutboxTopic is "the destination topic of returned messages
// written to the outbox". Set without ConsumerConfig.Outbox it does
// nothing: the returned messages are published by the router to the
// handler's publish topic after the commit (the window the outbox closes),
// not to OutboxTopic. Validate and NewConsumer accept that configuration
// silently; they should refuse it, naming the field, as they refuse every
// other field NewConsumer cannot honour.
func TestConsumerConfigRefusesOutboxTopicWithoutOutbox(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	cfg := e.config("validate_outbox_topic")
	cfg.OutboxTopic = "shipping.requested"
	err := cfg.Validate()
	require.Error(t, err, "OutboxTopic without an Outbox is ignored silently")
	require.ErrorContains(t, err, "ConsumerConfig.OutboxTopic")
	_, err = middleware.NewConsumer(cfg, nil)
	require.ErrorContains(t, err, "ConsumerConfig.OutboxTopic")
}
