package marshaler

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

func TestMetadataAccessors(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("id", nil)

	_, ok := Malformed(msg)
	require.False(t, ok)
	msg.Metadata.Set(MetadataMalformed, "false")
	_, ok = Malformed(msg)
	require.False(t, ok)
	msg.Metadata.Set(MetadataMalformed, "true")
	msg.Metadata.Set(MetadataMalformedReason, "envelope: empty body")
	reason, ok := Malformed(msg)
	require.True(t, ok)
	require.Equal(t, "envelope: empty body", reason)

	require.Equal(t, "", EventName(msg))
	msg.Metadata.Set(MetadataEventName, "a.b")
	require.Equal(t, "a.b", EventName(msg))

	_, err := OccurredAt(msg)
	require.ErrorContains(t, err, "missing")
	msg.Metadata.Set(MetadataOccurredAt, "2024-07-01 10:00:00")
	_, err = OccurredAt(msg)
	require.ErrorContains(t, err, "RFC 3339")
	msg.Metadata.Set(MetadataOccurredAt, "2024-07-01T10:00:00.987654321-03:00")
	at, err := OccurredAt(msg)
	require.NoError(t, err)
	require.True(t, at.Equal(time.Date(2024, 7, 1, 13, 0, 0, 987654321, time.UTC)))

	require.False(t, Redelivered(msg))
	msg.Metadata.Set(MetadataRedelivered, "true")
	require.True(t, Redelivered(msg))

	for _, bad := range []string{"", "-1", "x", "1.5"} {
		msg.Metadata.Set(MetadataDeliveryCount, bad)
		_, ok = DeliveryCount(msg)
		require.False(t, ok, bad)
	}
	msg.Metadata.Set(MetadataDeliveryCount, "12")
	n, ok := DeliveryCount(msg)
	require.True(t, ok)
	require.Equal(t, int64(12), n)

	// nil messages are handled, not panicked on.
	_, ok = Malformed(nil)
	require.False(t, ok)
	require.Equal(t, "", EventName(nil))
	_, err = OccurredAt(nil)
	require.Error(t, err)
	require.False(t, Redelivered(nil))
	_, ok = DeliveryCount(nil)
	require.False(t, ok)
}

func TestReservedKeys(t *testing.T) {
	t.Parallel()
	for _, k := range []string{MetadataEventName, MetadataOccurredAt, MetadataMalformed, MetadataMalformedReason,
		MetadataRedelivered, MetadataDeliveryCount, MetadataExtraPrefix + "x", MetadataExtraPrefix,
		"idempotency_envelope", "idempotency_uncounted_delivery", "idempotency_position"} {
		require.True(t, ReservedKey(k), k)
	}
	for _, k := range []string{"x-death", "x-delivery-count", "correlation_id", "envelope", "Event_Name"} {
		require.False(t, ReservedKey(k), k)
	}
}

// The keys that describe the delivery received (the redelivered flag, the
// delivery count, the crash bound's marks) belong to that delivery: an
// adapter publishing the message (a republish, a dead-letter copy) leaves
// them out of the headers, malformed or not, and keeps the message's own.
func TestEncodeMessageLeavesTheDeliveryKeysOut(t *testing.T) {
	t.Parallel()
	delivery := []string{MetadataRedelivered, MetadataDeliveryCount, "idempotency_uncounted_delivery", "idempotency_position"}
	msg, err := NewMessage("order.placed", map[string]int{"n": 1})
	require.NoError(t, err)
	bad := NewMalformed([]byte("{"), "", "not JSON")
	for _, m := range []*message.Message{msg, bad} {
		for _, k := range delivery {
			m.Metadata.Set(k, "1")
		}
		m.Metadata.Set("correlation_id", "c-1")
		_, headers, err := EncodeMessage(m, 0)
		require.NoError(t, err)
		for _, k := range delivery {
			require.NotContains(t, headers, k)
		}
		require.Equal(t, "c-1", headers["correlation_id"])
	}
}
