package jetstream

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// natsURL is NATS_URL or the shared server; a server that cannot be reached
// skips the test, or fails it under IDEMPOTENCY_FULL_TEST or CI.
func natsURL(t *testing.T) string {
	t.Helper()
	u := os.Getenv("NATS_URL")
	if u == "" {
		u = "nats://127.0.0.1:4222"
	}
	nc, err := nats.Connect(u, nats.Timeout(2*time.Second))
	if err != nil {
		if os.Getenv("IDEMPOTENCY_FULL_TEST") != "" || os.Getenv("CI") != "" {
			t.Fatalf("NATS at %s: %v", u, err)
		}
		t.Skipf("NATS at %s: %v", u, err)
	}
	nc.Close()
	return u
}

// testStream creates a stream of its own for the test (subject = name) and
// returns its name and a JetStream context for the test's checks.
func testStream(t *testing.T, url string) (string, nats.JetStreamContext) {
	t.Helper()
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	name := "idem_" + strings.ReplaceAll(uuid.NewString()[:13], "-", "")
	_, err = js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name, name + ".>"}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(name) })
	return name, js
}

func newEvent(t *testing.T) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessage("order.placed", map[string]int{"order_id": 42})
	require.NoError(t, err)
	return msg
}

// publish stores msg the way a producer publishing with watermill-nats'
// publisher and Marshaler does (Nats-Msg-Id "<event id>:<subject>"). The
// outbox relay publishes with Publisher (a Nats-Msg-Id per publish).
func publish(t *testing.T, url, topic string, msgs ...*message.Message) {
	t.Helper()
	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: url, Marshaler: Marshaler{}}, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic, msgs...))
}

func newSubscriber(t *testing.T, cfg SubscriberConfig) *Subscriber {
	t.Helper()
	s, err := NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func receive(t *testing.T, ch <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		require.True(t, ok, "subscription channel closed")
		return msg
	case <-time.After(within):
		t.Fatalf("no message within %s", within)
		return nil
	}
}

func consumerInfo(t *testing.T, js nats.JetStreamContext, stream, durable string) *nats.ConsumerInfo {
	t.Helper()
	ci, err := js.ConsumerInfo(stream, durable)
	require.NoError(t, err)
	return ci
}

func TestSubscriberConfigValidate(t *testing.T) {
	t.Parallel()
	ok := SubscriberConfig{URL: "nats://x", Stream: "s", Durable: "d"}.withDefaults()
	require.NoError(t, ok.Validate())
	require.Equal(t, AckWaitDefault, ok.AckWait)
	require.Equal(t, MaxHoldDefault, ok.MaxHold)
	// guarantees.md: "While a delivery is held, its subscription receives
	// nothing else": the consumer gives a held delivery back before the
	// subscriber's in-progress acks stop and JetStream redelivers it.
	require.Greater(t, MaxHoldDefault, middleware.DefaultMaxHold)
	for name, c := range map[string]SubscriberConfig{
		"no url":           {Stream: "s", Durable: "d"},
		"no stream":        {URL: "u", Durable: "d"},
		"no durable":       {URL: "u", Stream: "s"},
		"ack wait < 1s":    {URL: "u", Stream: "s", Durable: "d", AckWait: 500 * time.Millisecond},
		"hold < ack wait":  {URL: "u", Stream: "s", Durable: "d", AckWait: time.Minute, MaxHold: time.Second},
		"negative pending": {URL: "u", Stream: "s", Durable: "d", MaxAckPending: -1},
	} {
		require.Error(t, c.withDefaults().Validate(), name)
		_, err := NewSubscriber(c, nil)
		require.Error(t, err, name)
	}
}

// TestWatermillNATSDeletesTheDurableItCreated pins the trap SubscriberConfig
// avoids: with a plain watermill-nats configuration the durable consumer is
// created by nats.go, whose Unsubscribe (called by watermill-nats' Close)
// deletes it, with its ack floor.
func TestWatermillNATSDeletesTheDurableItCreated(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
		URL: url, QueueGroupPrefix: "plain", Unmarshaler: Marshaler{}, CloseTimeout: time.Second,
		JetStream: wmnats.JetStreamConfig{DurablePrefix: "plain"},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	_, err = sub.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	consumerInfo(t, js, stream, "plain")
	require.NoError(t, sub.Close())
	require.Eventually(t, func() bool {
		_, err := js.ConsumerInfo(stream, "plain")
		return errors.Is(err, nats.ErrConsumerNotFound)
	}, 5*time.Second, 50*time.Millisecond)
}

func TestSubscriberKeepsDurableOnClose(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second, CloseTimeout: time.Second})
	ch, err := s.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	msg := newEvent(t)
	publish(t, url, stream, msg)
	got := receive(t, ch, 5*time.Second)
	require.Equal(t, msg.UUID, got.UUID)
	got.Ack()
	require.Eventually(t, func() bool { return consumerInfo(t, js, stream, "svc").AckFloor.Stream == 1 }, 5*time.Second, 20*time.Millisecond)
	require.NoError(t, s.Close())

	ci := consumerInfo(t, js, stream, "svc")
	require.Equal(t, uint64(1), ci.AckFloor.Stream, "the ack floor survives the shutdown")
	require.Equal(t, nats.AckExplicitPolicy, ci.Config.AckPolicy)
	require.Equal(t, 2*time.Second, ci.Config.AckWait)
	require.Equal(t, "svc", ci.Config.DeliverGroup)

	// A restarted service resumes after the ack floor.
	next := newEvent(t)
	publish(t, url, stream, next)
	s2 := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second})
	ch2, err := s2.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	got = receive(t, ch2, 5*time.Second)
	require.Equal(t, next.UUID, got.UUID)
	got.Ack()
}

// TestSubscriberNeverAcksUnfinishedDelivery: a delivery still with its
// handler when the subscriber closes is not acked (nats.go's auto-ack would
// ack it when watermill-nats' callback returns on Close); it comes back.
func TestSubscriberNeverAcksUnfinishedDelivery(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	cfg := SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: time.Second, CloseTimeout: 200 * time.Millisecond}
	s := newSubscriber(t, cfg)
	ch, err := s.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	msg := newEvent(t)
	publish(t, url, stream, msg)
	held := receive(t, ch, 5*time.Second) // the handler never finishes
	require.NoError(t, s.Close())
	held.Ack() // too late: watermill-nats stopped waiting

	require.Equal(t, 1, consumerInfo(t, js, stream, "svc").NumAckPending, "the unfinished delivery must not be acked")
	s2 := newSubscriber(t, cfg)
	ch2, err := s2.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	again := receive(t, ch2, 5*time.Second)
	require.Equal(t, msg.UUID, again.UUID)
	require.True(t, marshaler.Redelivered(again))
	again.Ack()
}

// TestSubscriberHoldExtendsAckDeadline: a handler holding a delivery three
// times AckWait gets it once; the in-progress acks keep it from being
// redelivered.
func TestSubscriberHoldExtendsAckDeadline(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: time.Second, MaxHold: time.Minute, SubscribersCount: 2})
	ch, err := s.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	msg := newEvent(t)
	publish(t, url, stream, msg)
	held := receive(t, ch, 5*time.Second)
	select {
	case again := <-ch:
		t.Fatalf("redelivered while held: %s", again.UUID)
	case <-time.After(3 * time.Second):
	}
	held.Ack()
	require.Eventually(t, func() bool {
		ci := consumerInfo(t, js, stream, "svc")
		return ci.NumAckPending == 0 && ci.AckFloor.Stream == 1
	}, 5*time.Second, 20*time.Millisecond)
	require.Zero(t, consumerInfo(t, js, stream, "svc").NumRedelivered)
}

// TestSubscriberKilledConsumerRedeliveredWithinAckWait: a consumer that
// dies holding a delivery (its connection gone, no more progress acks)
// releases it to the other member of the group after AckWait.
func TestSubscriberKilledConsumerRedeliveredWithinAckWait(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, _ := testStream(t, url)
	cfg := SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second, MaxHold: time.Minute}
	a := newSubscriber(t, cfg)
	chA, err := a.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	msg := newEvent(t)
	publish(t, url, stream, msg)
	receive(t, chA, 5*time.Second)

	b := newSubscriber(t, cfg)
	chB, err := b.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	a.nc.Close() // the process dies: no ack, no progress ack
	start := time.Now()
	got := receive(t, chB, 10*time.Second)
	require.Equal(t, msg.UUID, got.UUID)
	require.Less(t, time.Since(start), cfg.AckWait+time.Second)
	got.Ack()
}

// TestSubscriberResumesAfterConsumerDeleted: the durable consumer deleted
// under a running subscriber (jsm.go#101) is noticed, counted, and
// recreated after its ack floor: the next event arrives, the acked one is
// not redelivered.
func TestSubscriberResumesAfterConsumerDeleted(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	var mu sync.Mutex
	var lost []ConsumerLost
	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: "svc", AckWait: 2 * time.Second,
		WatchInterval: 100 * time.Millisecond,
		OnConsumerLost: func(l ConsumerLost) {
			mu.Lock()
			defer mu.Unlock()
			lost = append(lost, l)
		}})
	var seenFloor atomic.Uint64
	s.onLookUp = seenFloor.Store
	ch, err := s.Subscribe(context.Background(), stream)
	require.NoError(t, err)
	first := newEvent(t)
	publish(t, url, stream, first)
	got := receive(t, ch, 5*time.Second)
	got.Ack()
	require.Eventually(t, func() bool { return seenFloor.Load() == 1 }, 5*time.Second, 10*time.Millisecond, "the watch sees the ack floor")

	require.NoError(t, js.DeleteConsumer(stream, "svc"))
	second := newEvent(t)
	publish(t, url, stream, second)
	// A copy of first already on its way before the deletion (a
	// redelivery under load) may come first; the recreated consumer itself
	// starts after the ack floor (OptStartSeq below).
	for got = receive(t, ch, 10*time.Second); got.UUID != second.UUID; got = receive(t, ch, 10*time.Second) {
		require.Equal(t, first.UUID, got.UUID)
		got.Ack()
	}
	got.Ack()
	require.Eventually(t, func() bool { return s.ConsumerLosses() == 1 }, 5*time.Second, 10*time.Millisecond)
	mu.Lock()
	require.Equal(t, []ConsumerLost{{Stream: stream, Durable: "svc", Resumed: true}}, lost)
	mu.Unlock()
	require.Equal(t, uint64(2), consumerInfo(t, js, stream, "svc").Config.OptStartSeq)
}

// watchedSubscription is a subscription of durable "svc" whose watch looks
// every 100 ms, with the losses it reports.
type watchedSubscription struct {
	s      *Subscriber
	ch     <-chan *message.Message
	js     nats.JetStreamContext
	stream string
	lost   chan ConsumerLost
}

func newWatchedSubscription(t *testing.T) *watchedSubscription {
	t.Helper()
	url := natsURL(t)
	w := &watchedSubscription{lost: make(chan ConsumerLost, 1)}
	w.stream, w.js = testStream(t, url)
	w.s = newSubscriber(t, SubscriberConfig{URL: url, Stream: w.stream, Durable: "svc", AckWait: 2 * time.Second,
		WatchInterval: 100 * time.Millisecond, CloseTimeout: time.Second,
		OnConsumerLost: func(l ConsumerLost) { w.lost <- l }})
	var err error
	w.ch, err = w.s.Subscribe(context.Background(), w.stream)
	require.NoError(t, err)
	return w
}

// ended waits for the one loss the watch reports, which ends the
// subscription, and returns it once the channel has closed.
func (w *watchedSubscription) ended(t *testing.T, what string) ConsumerLost {
	t.Helper()
	var l ConsumerLost
	select {
	case l = <-w.lost:
	case <-time.After(10 * time.Second):
		t.Fatal(what + " was not noticed")
	}
	require.False(t, l.Resumed)
	require.ErrorIs(t, l.Err, ErrConsumerLost)
	select {
	case _, ok := <-w.ch:
		require.False(t, ok, "the subscription must end")
	case <-time.After(5 * time.Second):
		t.Fatal("the subscription channel stayed open")
	}
	require.Equal(t, uint64(1), w.s.ConsumerLosses())
	return l
}

// A durable consumer updated in place (its Created unchanged) with a
// MaxDeliver, past which JetStream would drop an event held through an
// outage, ends the subscription as Subscribe would have refused it:
// counted, reported with the reason, the channel closed.
func TestSubscriberEndsWhenConsumerGetsADeliveryLimitInPlace(t *testing.T) {
	t.Parallel()
	w := newWatchedSubscription(t)
	updated := consumerInfo(t, w.js, w.stream, "svc").Config
	updated.MaxDeliver = 3
	_, err := w.js.UpdateConsumer(w.stream, &updated)
	require.NoError(t, err)
	l := w.ended(t, "the in-place change")
	require.False(t, l.Recreated)
	require.ErrorContains(t, l.Err, "MaxDeliver 3")
}

// TestSubscriberEndsWhenConsumerReplaced: a durable consumer recreated by
// someone else with another deliver subject would leave the subscription
// silently empty; the subscriber counts it and closes its channel.
func TestSubscriberEndsWhenConsumerReplaced(t *testing.T) {
	t.Parallel()
	w := newWatchedSubscription(t)
	replacement := consumerInfo(t, w.js, w.stream, "svc").Config
	replacement.DeliverSubject = nats.NewInbox()
	require.NoError(t, w.js.DeleteConsumer(w.stream, "svc"))
	_, err := w.js.AddConsumer(w.stream, &replacement)
	require.NoError(t, err)
	require.True(t, w.ended(t, "the replaced consumer").Recreated)
	consumerInfo(t, w.js, w.stream, "svc") // the replacement is not deleted
}

func TestSubscriberRefusesIncompatibleConsumer(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	_, err := js.AddConsumer(stream, &nats.ConsumerConfig{Durable: "pull", AckPolicy: nats.AckExplicitPolicy, FilterSubject: stream})
	require.NoError(t, err)
	_, err = js.AddConsumer(stream, &nats.ConsumerConfig{Durable: "slow", DeliverSubject: nats.NewInbox(), DeliverGroup: "slow",
		AckPolicy: nats.AckExplicitPolicy, AckWait: time.Hour, FilterSubject: stream})
	require.NoError(t, err)
	// A delivery limit: past it JetStream drops an event held through an
	// outage or crashing the process, neither applied nor dead-lettered.
	_, err = js.AddConsumer(stream, &nats.ConsumerConfig{Durable: "limited", DeliverSubject: nats.NewInbox(), DeliverGroup: "limited",
		AckPolicy: nats.AckExplicitPolicy, AckWait: time.Second, FilterSubject: stream, MaxDeliver: 2})
	require.NoError(t, err)
	for durable, want := range map[string]string{"pull": "pull consumer", "slow": "AckWait 1h0m0s exceeds", "limited": "MaxDeliver 2; unlimited (-1) is needed"} {
		s := newSubscriber(t, SubscriberConfig{URL: url, Stream: stream, Durable: durable})
		_, err := s.Subscribe(context.Background(), stream)
		require.ErrorContains(t, err, want)
	}
	s := newSubscriber(t, SubscriberConfig{URL: url, Stream: "idem_missing_stream", Durable: "d"})
	_, err = s.Subscribe(context.Background(), stream)
	require.Error(t, err)
}
