package operation_test

import (
	"context"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// An uncertain operation whose error text and reference are larger than
// RabbitMQ's frame (a provider's whole response, 300 kB each) is routed to
// the reconciliation queue once, its headers cut to 4 KiB each on a rune
// boundary and saying so; the publish succeeds, so the message is acked and
// nothing loops. Unbounded, the broker refused the header frame on every
// redelivery and the route reported a transient error each time.
func TestRouteUncertainLargerThanTheFrameReachesTheQueueWithBoundedHeaders(t *testing.T) {
	t.Parallel()
	topic := testenv.UniqueName("op_recon")
	cfg := amqp.NewDurableQueueConfig(testenv.AMQPURL())
	pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
	require.NoError(t, err, "RabbitMQ at %s", testenv.AMQPURL())
	t.Cleanup(func() { _ = pub.Close() })
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic) // declares the queue before the publish
	require.NoError(t, err)

	route, err := operation.RouteUncertain(pub, topic, nil)
	require.NoError(t, err)
	huge := strings.Repeat("ü", 150_000) // 300 kB, two bytes a rune
	uncertain := &operation.UncertainError{Key: "charge:p-1", Kind: "charge", Reference: huge, Cause: errorText(huge)}
	_, err = route(func(*message.Message) ([]*message.Message, error) { return nil, uncertain })(message.NewMessage(idE5, []byte(`{}`)))
	require.NoError(t, err, "routed and acked, not a transient error")
	require.False(t, inbox.IsTransient(err))

	select {
	case m := <-msgs:
		m.Ack()
		require.Equal(t, idE5, m.UUID)
		require.Equal(t, "charge:p-1", m.Metadata.Get(operation.MetadataKey))
		for _, k := range []string{operation.MetadataReason, operation.MetadataReference} {
			v := m.Metadata.Get(k)
			require.LessOrEqual(t, len(v), 4096, k)
			require.Greater(t, len(v), 4000, k)
			require.True(t, utf8.ValidString(v), k)
			require.Contains(t, v, "(truncated, ", k)
		}
		require.True(t, strings.HasPrefix(m.Metadata.Get(operation.MetadataReference), "üüü"))
	case <-ctx.Done():
		t.Fatal("the routed message never reached the reconciliation queue")
	}
}

type errorText string

func (e errorText) Error() string { return string(e) }
