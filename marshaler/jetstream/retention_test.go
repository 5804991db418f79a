package jetstream

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// retentionStream adds a stream of its own with cfg's retention, deleted
// at the end of the test.
func retentionStream(t *testing.T, js nats.JetStreamContext, cfg nats.StreamConfig) string {
	t.Helper()
	name := "ret_" + strings.ReplaceAll(uuid.NewString()[:13], "-", "")
	cfg.Name = name
	cfg.Subjects = []string{name + ".>"}
	_, err := js.AddStream(&cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(name) })
	return name
}

// On a stream with interest retention the server drops every message no
// consumer is interested in when the last consumer goes away: a deleted
// durable would take the deliveries not yet acked with it, and the watch
// would recreate it with nothing to deliver. Subscribe refuses such a
// stream, naming its retention, before any message is received.
func TestSubscriberRefusesInterestRetentionStream(t *testing.T) {
	url := natsURL(t)
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	stream := retentionStream(t, js, nats.StreamConfig{Retention: nats.InterestPolicy})

	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second, CloseTimeout: time.Second})
	_, err = s.Subscribe(context.Background(), stream+".orders")
	require.Error(t, err)
	require.Contains(t, err.Error(), "interest")
	_, err = js.ConsumerInfo(stream, "svc")
	require.ErrorIs(t, err, nats.ErrConsumerNotFound, "a durable was created on a stream that is refused")
}

// On a work-queue stream (and a limits one, TestSubscriberResumesAfterConsumerDeleted)
// a durable deleted under the subscriber is recreated from its ack floor
// and nothing unacked is lost: the messages stay until acked.
func TestSubscriberConsumerDeletedOnWorkQueueStreamLosesNothing(t *testing.T) {
	url := natsURL(t)
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	stream := retentionStream(t, js, nats.StreamConfig{Retention: nats.WorkQueuePolicy})
	topic := stream + ".orders"

	lostCh := make(chan ConsumerLost, 4)
	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second,
		WatchInterval: 100 * time.Millisecond, CloseTimeout: time.Second,
		OnConsumerLost: func(l ConsumerLost) { lostCh <- l }})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := s.Subscribe(ctx, topic)
	require.NoError(t, err)

	const n = 5
	for i := 0; i < n; i++ {
		publish(t, url, topic, newEvent(t))
	}
	first := receive(t, ch, 10*time.Second) // in the handler's hands, not acked

	require.NoError(t, js.DeleteConsumer(stream, "svc"))
	l := <-lostCh
	require.True(t, l.Resumed, "the watch did not recreate the durable")
	si, err := js.StreamInfo(stream)
	require.NoError(t, err)
	require.Equal(t, uint64(n), si.State.Msgs, "unacked messages were dropped while the durable was recreated")
	first.Ack()
}
