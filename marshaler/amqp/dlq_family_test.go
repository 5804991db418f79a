package amqp_test

import (
	"strings"
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// A custom queue generator that groups topics by family (a queue per
// routing-key prefix) never names the dead-letter queue as a queue of the
// consumer's topics: the configuration is valid. Probes derived from the
// dead-letter topic fell in its own "family" and refused it. A generator
// that panics on a topic it does not expect is not called unguarded.
func TestDeadLetterConfigAcceptsFamilyQueueGenerators(t *testing.T) {
	t.Parallel()
	for name, gen := range map[string]wamqp.QueueNameGenerator{
		"parent":  func(topic string) string { return topic[:strings.LastIndex(topic, ".")] }, // stock.events.reserved -> stock.events
		"segment": func(topic string) string { return strings.SplitN(topic, ".", 2)[0] },      // stock.reserved -> stock
		"strict": func(topic string) string { // panics on topics outside its naming scheme
			if !strings.HasPrefix(topic, "stock.") {
				panic("unexpected topic " + topic)
			}
			return topic + "_q"
		},
	} {
		cfg := wamqp.NewDurableTopicConfig(testenv.AMQPURL(), "events", "unused")
		cfg.Marshaler = idamqp.Marshaler{}
		cfg.Queue.GenerateName = gen
		dlq := map[string]string{"parent": "stock.events.dlq", "segment": "stock_dlq", "strict": "stock.dlq"}[name]
		consumerQueue := gen(map[string]string{"parent": "stock.events.reserved", "segment": "stock.reserved", "strict": "stock.reserved"}[name])
		require.NotEqual(t, dlq, consumerQueue, "the dead-letter queue is not the consumer's queue")
		require.NoError(t, idamqp.DeadLetterConfig{Subscriber: cfg, Topic: dlq, Quorum: true}.Validate(), name)
	}
}
