package shop

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
)

// DefaultJetStreamAckWait is the AckWait of the consumers JetStreamTransport
// declares: how long JetStream waits for an ack before it redelivers.
const DefaultJetStreamAckWait = 2 * time.Second

// DefaultJetStreamMaxAckPending is the MaxAckPending of the consumers
// JetStreamTransport declares: how many deliveries may wait unacked. The
// watermill-nats subscriber hands them to the router one at a time per
// subscription, so a large value lets deliveries wait in the client past
// AckWait, and JetStream redelivers them while the first copy is still
// queued (harmless here, but wasted work).
const DefaultJetStreamMaxAckPending = 4

// JetStreamTransport is NATS JetStream with the shop's layout, built on
// watermill-nats v2 (pkg/nats, JetStream mode) and marshaler/jetstream:
//
//   - one events stream, Prefix+"_events", on the subjects
//     Prefix+".ev.<event name>";
//   - per consumer a durable push consumer of that stream (its name, with a
//     deliver group so that its workers compete), filtered on its bindings
//     (NATS 2.9 consumers take one filter: several bindings are filtered on
//     their common prefix, and the Subscriber acks and skips the other
//     events);
//   - per consumer a dead-letter stream and a reconciliation stream
//     (Prefix+"_<name>_dlq", Prefix+"_<name>_reconcile").
//
// Declare the streams and consumers with Declare before starting services.
type JetStreamTransport struct {
	// URL is the NATS server of the publishers and, unless SubscriberURL is
	// set, of the subscribers ("nats://127.0.0.1:4222").
	URL string
	// SubscriberURL, when not "", is the subscribers' URL (a fault proxy).
	SubscriberURL string
	// Prefix names the streams and subjects: letters, digits, '_' and '-'.
	// Required.
	Prefix string
	// AckWait is the consumers' ack wait. Defaults to DefaultJetStreamAckWait.
	AckWait time.Duration
	// Workers is the number of concurrent subscriptions per consumer.
	// Defaults to 1.
	Workers int
	// MaxAckPending bounds the unacked deliveries per consumer. Defaults to
	// DefaultJetStreamMaxAckPending.
	MaxAckPending int
}

var _ Transport = JetStreamTransport{}

// EventsStream is the stream of every event.
func (t JetStreamTransport) EventsStream() string { return t.Prefix + "_events" }

// Subject is the subject an event named eventName is published on.
func (t JetStreamTransport) Subject(eventName string) string { return t.Prefix + ".ev." + eventName }

// Durable is c's durable consumer (and deliver group) name.
func (t JetStreamTransport) Durable(c Consumer) string { return natsName(c.Name) }

// DeadLetterStream is c's dead-letter stream.
func (t JetStreamTransport) DeadLetterStream(c Consumer) string {
	return t.Prefix + "_" + natsName(c.Name) + "_dlq"
}

// ReconcileStream is c's reconciliation stream.
func (t JetStreamTransport) ReconcileStream(c Consumer) string {
	return t.Prefix + "_" + natsName(c.Name) + "_reconcile"
}

func (t JetStreamTransport) deadLetterSubject(c Consumer) string {
	return t.Prefix + ".dlq." + natsName(c.Name)
}

func (t JetStreamTransport) reconcileSubject(c Consumer) string {
	return t.Prefix + ".reconcile." + natsName(c.Name)
}

// natsName keeps the characters stream and consumer names allow.
func natsName(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '_', r == '-':
			return r
		}
		return '_'
	}, s)
}

// filterSubject is the one subject filter that covers every binding of c
// (AMQP-style '#' patterns become '>').
func (t JetStreamTransport) filterSubject(c Consumer) string {
	var common []string
	for i, b := range c.Bindings {
		toks := strings.Split(strings.ReplaceAll(b, "#", ">"), ".")
		if i == 0 {
			common = toks
			continue
		}
		n := 0
		for n < len(common) && n < len(toks) && common[n] == toks[n] && common[n] != ">" {
			n++
		}
		if n < len(common) || n < len(toks) {
			common = append(common[:n:n], ">")
		}
	}
	return t.Subject(strings.Join(common, "."))
}

func (t JetStreamTransport) ackWait() time.Duration {
	if t.AckWait <= 0 {
		return DefaultJetStreamAckWait
	}
	return t.AckWait
}

func (t JetStreamTransport) maxAckPending() int {
	if t.MaxAckPending <= 0 {
		return DefaultJetStreamMaxAckPending
	}
	return t.MaxAckPending
}

// Declare creates the events stream and, for each consumer, its durable
// consumer and its dead-letter and reconciliation streams (file storage).
// The events stream also takes the relay's probe: EventsPublisher publishes
// the probe topic (outbox.probe) on Subject("outbox.probe") (without a
// stream the probe would come back unroutable, which shows the server up as
// well); a consumer whose bindings do not name it acks and skips it.
func (t JetStreamTransport) Declare(js nats.JetStreamContext, consumers ...Consumer) error {
	if t.Prefix == "" {
		return errors.New("shop: JetStreamTransport.Prefix is required")
	}
	if _, err := js.AddStream(&nats.StreamConfig{Name: t.EventsStream(), Subjects: []string{t.Prefix + ".ev.>"}, Storage: nats.FileStorage}); err != nil {
		return err
	}
	for _, c := range consumers {
		if err := (Topology{}).Validate(c); err != nil { // the same naming rules
			return err
		}
		for name, subject := range map[string]string{t.DeadLetterStream(c): t.deadLetterSubject(c), t.ReconcileStream(c): t.reconcileSubject(c)} {
			if _, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{subject}, Storage: nats.FileStorage}); err != nil {
				return err
			}
		}
		if _, err := js.AddConsumer(t.EventsStream(), &nats.ConsumerConfig{
			Durable: t.Durable(c), DeliverSubject: nats.NewInbox(), DeliverGroup: t.Durable(c),
			AckPolicy: nats.AckExplicitPolicy, AckWait: t.ackWait(), DeliverPolicy: nats.DeliverAllPolicy,
			FilterSubject: t.filterSubject(c), MaxAckPending: t.maxAckPending(),
		}); err != nil {
			return err
		}
	}
	return nil
}

// Delete removes what Declare created.
func (t JetStreamTransport) Delete(js nats.JetStreamContext, consumers ...Consumer) error {
	err := js.DeleteStream(t.EventsStream())
	for _, c := range consumers {
		err = errors.Join(err, js.DeleteStream(t.DeadLetterStream(c)), js.DeleteStream(t.ReconcileStream(c)))
	}
	return err
}

// publisher is marshaler/jetstream's Publisher, for the relay, poison and
// reconciliation alike: a Nats-Msg-Id per publish, the PubAck read, a full
// stream reported as back-pressure and a subject without a stream as
// unroutable.
func (t JetStreamTransport) publisher(watermill.LoggerAdapter) (*jetstream.Publisher, error) {
	return jetstream.NewPublisher(jetstream.PublisherConfig{
		URL:         t.URL,
		NatsOptions: []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)},
	})
}

// Subscriber implements Transport: the workers of c's durable consumer. The
// topic given to Subscribe is ignored.
func (t JetStreamTransport) Subscriber(c Consumer, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	url := t.SubscriberURL
	if url == "" {
		url = t.URL
	}
	workers := t.Workers
	if workers < 1 {
		workers = 1
	}
	s := &jetStreamSubscriber{t: t, c: c}
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
		URL: url, QueueGroupPrefix: t.Durable(c), SubscribersCount: workers,
		AckWaitTimeout: 30 * time.Second, CloseTimeout: 30 * time.Second,
		Unmarshaler: jetstream.Marshaler{},
		// AckAsync: an ack is not waited for; a lost one is a redelivery, which
		// the claim skips.
		JetStream: wmnats.JetStreamConfig{DurablePrefix: t.Durable(c), AckAsync: true},
		NatsOptions: []nats.Option{
			nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond),
			// Every (re)connection is dialled here, before any message
			// arrives on it: the session number is never late.
			nats.SetCustomDialer(sessionDialer{sessions: &s.sessions}),
			// An ack made while the connection is down is dropped, not
			// buffered and sent after the reconnection: as with AMQP, a
			// broken connection loses the acks in flight and JetStream
			// redelivers those messages after AckWait (the claim skips them).
			nats.ReconnectBufSize(-1),
		},
	}, logger)
	if err != nil {
		return nil, err
	}
	s.sub = sub
	return s, nil
}

// sessionDialer counts the connections it dials.
type sessionDialer struct{ sessions *atomic.Uint64 }

func (d sessionDialer) Dial(network, address string) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: 2 * time.Second}).Dial(network, address)
	if err == nil {
		d.sessions.Add(1)
	}
	return c, err
}

// jetStreamSubscriber consumes c's durable consumer, acks and skips the
// events outside c's bindings, and records the connection (session) of each
// delivery for SessionFromContext.
type jetStreamSubscriber struct {
	t        JetStreamTransport
	c        Consumer
	sub      *wmnats.Subscriber
	sessions atomic.Uint64
}

func (s *jetStreamSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	in, err := s.sub.Subscribe(ctx, s.t.filterSubject(s.c))
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range in {
			if _, bad := marshaler.Malformed(msg); !bad && !s.bound(marshaler.EventName(msg)) {
				msg.Ack()
				continue
			}
			msg.SetContext(context.WithValue(msg.Context(), sessionKey{}, s.sessions.Load()))
			select {
			case out <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

func (s *jetStreamSubscriber) bound(eventName string) bool {
	for _, b := range s.c.Bindings {
		if b == eventName {
			return true
		}
		if prefix, ok := strings.CutSuffix(b, "#"); ok && strings.HasPrefix(eventName, prefix) {
			return true
		}
	}
	return false
}

func (s *jetStreamSubscriber) Close() error { return s.sub.Close() }

// prefixPublisher publishes topic t on subject prefix(t).
type prefixPublisher struct {
	pub    message.Publisher
	prefix func(string) string
}

func (p prefixPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.pub.Publish(p.prefix(topic), msgs...)
}

func (p prefixPublisher) Close() error { return p.pub.Close() }

// EventsPublisher implements Transport: the Watermill topic (the event name)
// is published on Subject(topic).
func (t JetStreamTransport) EventsPublisher(logger watermill.LoggerAdapter) (message.Publisher, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, err
	}
	return prefixPublisher{pub: p, prefix: t.Subject}, nil
}

// PoisonPublisher implements Transport: a publisher whose topic is c's
// dead-letter subject.
func (t JetStreamTransport) PoisonPublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.deadLetterSubject(c), nil
}

// ReconcilePublisher implements Transport: a publisher whose topic is c's
// reconciliation subject.
func (t JetStreamTransport) ReconcilePublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.reconcileSubject(c), nil
}
