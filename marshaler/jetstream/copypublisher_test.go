package jetstream

import (
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// TestCopyPublisherStoresCopiesWithinDuplicateWindow: a redrive of an event
// to its own subject and two dead letters of one event, all within the
// duplicate window, are stored; the ordinary publisher's republish is
// dropped (nats-server#2921), which is right for the relay and wrong for
// copies.
func TestCopyPublisherStoresCopiesWithinDuplicateWindow(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	msgs := func() uint64 {
		si, err := js.StreamInfo(stream)
		require.NoError(t, err)
		return si.State.Msgs
	}
	event := newEvent(t)
	publish(t, url, stream, event)
	publish(t, url, stream, event) // the relay's republish: dropped, as intended
	require.Equal(t, uint64(1), msgs())

	p, err := NewCopyPublisher(CopyPublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.NoError(t, p.Publish(stream, event), "redrive")
	require.Equal(t, uint64(2), msgs())
	dlq := stream + ".dlq"
	require.NoError(t, p.Publish(dlq, event, event), "two dead letters of one event")
	require.Equal(t, uint64(4), msgs())

	bad := marshaler.NewMalformed([]byte("not json"), "m-1", "test")
	require.NoError(t, p.Publish(dlq, bad, bad))
	require.Equal(t, uint64(6), msgs())

	// The copies still carry the event's id for the consumer's claim.
	sub, err := js.SubscribeSync(stream, nats.OrderedConsumer(), nats.DeliverLast())
	require.NoError(t, err)
	nm, err := sub.NextMsg(5e9)
	require.NoError(t, err)
	got, _ := Marshaler{}.Unmarshal(nm)
	require.Equal(t, event.UUID, got.UUID)
	require.NotEqual(t, msgID(event.UUID, stream), nm.Header.Get(nats.MsgIdHdr))
	require.NoError(t, sub.Unsubscribe())
}

func TestCopyPublisherReportsDuplicatePubAck(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, _ := testStream(t, url)
	p, err := NewCopyPublisher(CopyPublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	p.newID = func() string { return "same-id" }
	event := newEvent(t)
	require.NoError(t, p.Publish(stream, event))
	err = p.Publish(stream, event)
	require.ErrorIs(t, err, ErrDuplicateCopy)
	require.ErrorContains(t, err, "same-id")
}
