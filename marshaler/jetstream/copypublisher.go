package jetstream

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// ErrDuplicateCopy is returned by [CopyPublisher.Publish] when JetStream
// answered a copy's publish with a PubAck marked Duplicate: nothing was
// stored.
var ErrDuplicateCopy = errors.New("jetstream: copy dropped by the stream's duplicate window")

// CopyPublisherConfig configures [NewCopyPublisher].
type CopyPublisherConfig struct {
	// URL of the NATS server. Required.
	URL string
	// NatsOptions are passed to nats.Connect.
	NatsOptions []nats.Option
	// PublishOptions are passed to each JetStream publish (e.g.
	// nats.ExpectStream). nats.MsgId is set by the publisher.
	PublishOptions []nats.PubOpt
	// Decoder's MaxSize bounds the published envelope (see [Marshaler]).
	Decoder marshaler.Decoder
}

// CopyPublisher publishes copies of events that must be stored even when
// the event itself was published moments ago: dead letters (the poison
// destination), DLQ redrives and replays. Each copy gets a Nats-Msg-Id of
// its own (a fresh UUIDv7): [Marshaler]'s "<event id>:<subject>" would make
// JetStream drop a redrive, a replay or a second dead letter of one event
// published within the stream's duplicate window, with a PubAck that
// reports success (nats-server#2921). It reads every PubAck and returns
// ErrDuplicateCopy when one says Duplicate. The body and the other headers
// are those of [Marshaler]: a consumer still sees the event's id, and its
// claim still skips a copy of an event it applied.
//
// Publish with the watermill-nats publisher for the outbox relay (its
// republishes should be dropped by the window); with CopyPublisher for
// everything that must be a new message.
type CopyPublisher struct {
	nc    *nats.Conn
	js    nats.JetStreamContext
	cfg   CopyPublisherConfig
	newID func() string // the copy's Nats-Msg-Id; tests replace it
}

var _ message.Publisher = (*CopyPublisher)(nil)

// NewCopyPublisher connects to cfg.URL.
func NewCopyPublisher(cfg CopyPublisherConfig) (*CopyPublisher, error) {
	if cfg.URL == "" {
		return nil, errors.New("jetstream: CopyPublisherConfig.URL is required")
	}
	nc, err := nats.Connect(cfg.URL, cfg.NatsOptions...)
	if err != nil {
		return nil, fmt.Errorf("jetstream: connect: %w", err)
	}
	js, err := nc.JetStream()
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &CopyPublisher{nc: nc, js: js, cfg: cfg, newID: func() string { return uuid.Must(uuid.NewV7()).String() }}, nil
}

// Publish stores each message in the stream of topic as a new message, in
// order, and stops at the first failure: a publish error, or a PubAck marked
// Duplicate (ErrDuplicateCopy). The copy's id is in the error.
func (p *CopyPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		nm, err := Marshaler{Decoder: p.cfg.Decoder}.Marshal(topic, msg)
		if err != nil {
			return err
		}
		id := p.newID()
		nm.Header.Set(nats.MsgIdHdr, id)
		ack, err := p.js.PublishMsg(nm, p.cfg.PublishOptions...)
		if err != nil {
			return fmt.Errorf("jetstream: publish copy %s of message %s to %q: %w", id, msg.UUID, topic, err)
		}
		if ack.Duplicate {
			return fmt.Errorf("%w: copy %s of message %s to %q (stream %s, sequence %d)", ErrDuplicateCopy, id, msg.UUID, topic, ack.Stream, ack.Sequence)
		}
	}
	return nil
}

// Close closes the connection.
func (p *CopyPublisher) Close() error {
	p.nc.Close()
	return nil
}
