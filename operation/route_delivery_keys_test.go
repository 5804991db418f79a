package operation_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/operation"
)

// The keys of the delivery received (redelivered,
// delivery_count, the crash bound's marks) must not travel with a copy of
// the message sent on. RouteUncertain sends a copy to the reconciliation
// topic; on a transport without an adapter (GoChannel, watermill-sql) the
// copy keeps them, and the reconciliation topic's consumer takes its first
// delivery for a redelivery of the old one (counted attempts, crash count
// capped by the old delivery_count).
func TestRoutedCopyGoesWithoutTheDeliveryKeys(t *testing.T) {
	t.Parallel()
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	out, err := pubsub.Subscribe(context.Background(), "reconcile")
	require.NoError(t, err)
	route, err := operation.RouteUncertain(pubsub, "reconcile", nil)
	require.NoError(t, err)

	msg, err := marshaler.NewMessage("payment.requested", map[string]string{"payment_id": "p-1"})
	require.NoError(t, err)
	// As adapters set them on the delivery received (JetStream, Redis
	// Streams through CountingClient, Redis without it, Kafka).
	delivery := testenv.DeliveryMetadata()
	for k, v := range delivery {
		msg.Metadata.Set(k, v)
	}
	uncertain := &operation.UncertainError{Key: "charge:p-1", Kind: "charge"}
	_, err = route(func(*message.Message) ([]*message.Message, error) { return nil, uncertain })(msg)
	require.NoError(t, err)

	select {
	case c := <-out:
		c.Ack()
		require.Equal(t, "charge:p-1", c.Metadata.Get(operation.MetadataKey))
		for k := range delivery {
			require.NotContains(t, c.Metadata, k, "the routed copy carries the delivery's key %s", k)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing routed")
	}
}
