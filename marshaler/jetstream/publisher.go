package jetstream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// ErrDuplicate is returned by [Publisher.Publish] when JetStream answered a
// publish with a PubAck marked Duplicate: nothing was stored.
var ErrDuplicate = errors.New("jetstream: message dropped by the stream's duplicate window")

// PublisherConfig configures [NewPublisher].
type PublisherConfig struct {
	// URL of the NATS server. Required.
	URL string
	// NatsOptions are passed to nats.Connect.
	NatsOptions []nats.Option
	// PublishOptions are passed to each JetStream publish (e.g.
	// nats.ExpectStream). nats.MsgId is set by the publisher. With
	// nats.AckWait among them the message's context is not passed to the
	// publish (nats.go takes one or the other).
	PublishOptions []nats.PubOpt
	// Decoder's MaxSize bounds the published envelope (see [Marshaler]).
	Decoder marshaler.Decoder
}

// Publisher is the publisher of everything that goes to JetStream: the
// outbox relay's events, dead letters (the poison destination), DLQ
// redrives and replays. Every publish gets a Nats-Msg-Id of its own (a
// fresh UUIDv7), so every message given is stored as a new message:
// [Marshaler]'s "<event id>:<subject>" would make JetStream drop a redrive,
// a replay or a second dead letter of one event published within the
// stream's duplicate window, with a PubAck that reports success
// (nats-server#2921). A relay's republish of a row is stored too; the
// consumer's claim skips it. It reads every PubAck and returns ErrDuplicate
// when one says Duplicate. The body and the other headers are those of
// [Marshaler]: a consumer still sees the event's id, and its claim still
// skips a copy of an event it applied.
//
// Publish tells JetStream's refusals apart, for outbox.Relay and any other
// caller that retries (the error wraps nats.go's, so errors.Is and
// errors.As still reach it):
//
//   - back-pressure (the error has a BackPressure method returning true,
//     the row is never counted against): a stream at its limits with
//     DiscardNew ("maximum messages exceeded", "maximum bytes exceeded",
//     "maximum messages per subject exceeded": API error 10077), the
//     server out of storage (10047, 10023) or memory (10028), the account
//     over its JetStream quota (10002), no PubAck in time
//     (nats.ErrTimeout: a leader election, a slow server) and the message's
//     context expired (context.DeadlineExceeded);
//   - unroutable (the error has an Unroutable method returning true, the
//     row waits for a stream): no stream takes the subject
//     (nats.ErrNoStreamResponse, nats.ErrNoResponders);
//   - anything else as nats.go returned it, the message's fault: a message
//     larger than the stream's MaxMsgSize (10054), and a 10077 refusal of
//     a message whose headers and data alone reach the MaxBytes of a
//     stream with DiscardNew (the stream's configuration, read after the
//     refusal, says so: the stream refuses it even empty, so it can never
//     be stored; the error says so too).
type Publisher struct {
	nc    *nats.Conn
	js    nats.JetStreamContext
	cfg   PublisherConfig
	newID func() string // the publish's Nats-Msg-Id; tests replace it
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher connects to cfg.URL.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.URL == "" {
		return nil, errors.New("jetstream: PublisherConfig.URL is required")
	}
	nc, js, err := connect(cfg.URL, cfg.NatsOptions)
	if err != nil {
		return nil, err
	}
	return &Publisher{nc: nc, js: js, cfg: cfg, newID: func() string { return uuid.Must(uuid.NewV7()).String() }}, nil
}

// Publish stores each message in the stream of topic as a new message, in
// order, and stops at the first failure: a publish error (classified as
// the type doc says), or a PubAck marked Duplicate (ErrDuplicate). The
// error names the subject, the message and its Nats-Msg-Id. A message
// whose context (msg.Context()) can end bounds the wait for its PubAck;
// otherwise the JetStream context's default wait (5s) does.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		nm, err := Marshaler{Decoder: p.cfg.Decoder}.Marshal(topic, msg)
		if err != nil {
			return err
		}
		id := p.newID()
		nm.Header.Set(nats.MsgIdHdr, id)
		ack, err := p.publish(msg.Context(), nm)
		if err != nil {
			return fmt.Errorf("jetstream: publish of message %s (Nats-Msg-Id %s) to %q: %w", msg.UUID, id, topic, p.refusal(msg.Context(), nm, err))
		}
		if ack.Duplicate {
			return fmt.Errorf("%w: message %s (Nats-Msg-Id %s) to %q (stream %s, sequence %d)", ErrDuplicate, msg.UUID, id, topic, ack.Stream, ack.Sequence)
		}
	}
	return nil
}

// publish publishes nm with ctx when ctx can end and PublishOptions set no
// AckWait (nats.go refuses both, ErrContextAndTimeout, before sending).
func (p *Publisher) publish(ctx context.Context, nm *nats.Msg) (*nats.PubAck, error) {
	if ctx != nil && ctx.Done() != nil {
		opts := append(p.cfg.PublishOptions[:len(p.cfg.PublishOptions):len(p.cfg.PublishOptions)], nats.Context(ctx))
		ack, err := p.js.PublishMsg(nm, opts...)
		if !errors.Is(err, nats.ErrContextAndTimeout) {
			return ack, err
		}
	}
	return p.js.PublishMsg(nm, p.cfg.PublishOptions...)
}

// refusal is classify(err) for nm's publish error, except for a message
// that can never fit its stream (neverFits): err itself, saying so, which
// is not back-pressure.
func (p *Publisher) refusal(ctx context.Context, nm *nats.Msg, err error) error {
	var api *nats.APIError
	if errors.As(err, &api) && api.ErrorCode == codeStoreFailed {
		if stream, size, maxBytes, ok := p.neverFits(ctx, nm); ok {
			return fmt.Errorf("%w: %d bytes of headers and data reach stream %s's MaxBytes %d (DiscardNew): it can never be stored", err, size, stream, maxBytes)
		}
	}
	return classify(err)
}

// neverFits reports whether nm, refused with 10077 (a stream limit with
// DiscardNew), can never be stored in the stream of its subject: the
// stream discards new messages at MaxBytes, and nm's headers and data
// alone reach it.
//
// Why the stream's configuration, and not its contents or a time bound:
// with DiscardNew the server refuses a message when the stream's stored
// bytes plus the message's headers and data reach MaxBytes (nats-server's
// file and memory stores), so a message whose headers and data alone
// reach MaxBytes is refused by the stream when empty too: no consumer,
// purge or age limit ever makes room for it, and a relay that waits for
// room wedges its subject for good. Any other refusal of a full stream may
// pass once room is made, however long its consumers are away: a time
// bound would dead-letter the rows of a long outage. Read from the
// configuration, the judgment races no consumer draining the stream.
// Whatever cannot be read (the lookups fail, ctx ends) leaves the refusal
// back-pressure. The relay counts the error against the row (dead-lettered
// after RelayConfig.MaxAttempts while its probe goes through), so a
// MaxBytes raised meanwhile lets the row through.
func (p *Publisher) neverFits(ctx context.Context, nm *nats.Msg) (stream string, size int, maxBytes int64, ok bool) {
	var opts []nats.JSOpt
	if ctx != nil && ctx.Done() != nil {
		opts = append(opts, nats.Context(ctx))
	}
	stream, err := p.js.StreamNameBySubject(nm.Subject, opts...)
	if err != nil {
		return "", 0, 0, false
	}
	info, err := p.js.StreamInfo(stream, opts...)
	if err != nil {
		return "", 0, 0, false
	}
	size = len(nm.Data) + headerSize(nm.Header)
	cfg := info.Config
	return stream, size, cfg.MaxBytes, cfg.Discard == nats.DiscardNew && cfg.MaxBytes > 0 && int64(size) >= cfg.MaxBytes
}

// headerSize is the size of h as nats.go sends it: "NATS/1.0\r\n", the
// lines of http.Header.Write, "\r\n"; 0 when h is empty.
func headerSize(h nats.Header) int {
	if len(h) == 0 {
		return 0
	}
	var b bytes.Buffer
	_ = http.Header(h).Write(&b)
	return len("NATS/1.0\r\n") + b.Len() + len("\r\n")
}

// Close closes the connection.
func (p *Publisher) Close() error {
	p.nc.Close()
	return nil
}

// JetStream API error codes (nats-server's ErrorIdentifier) that are
// back-pressure: the server cannot store the message now.
const (
	codeMemoryExceeded  nats.ErrorCode = 10028 // JSMemoryResourcesExceededErr: insufficient memory resources
	codeStorageExceeded nats.ErrorCode = 10047 // JSStorageResourcesExceededErr: insufficient storage resources
	codeStoreFailed     nats.ErrorCode = 10077 // JSStreamStoreFailedF: maximum messages/bytes/messages per subject exceeded (DiscardNew)
	codeAccountLimits   nats.ErrorCode = 10002 // JSAccountResourcesExceededErr: resource limits exceeded for account
	codeInsufficient    nats.ErrorCode = 10023 // JSInsufficientResourcesErr: insufficient resources (the server's store full)
)

// classify wraps a publish error of nats.go's in backPressureError or
// unroutableError when it is one (see [Publisher]); otherwise it returns
// err.
func classify(err error) error {
	var api *nats.APIError
	switch {
	case errors.As(err, &api) && (api.ErrorCode == codeStoreFailed || api.ErrorCode == codeStorageExceeded || api.ErrorCode == codeMemoryExceeded ||
		api.ErrorCode == codeAccountLimits || api.ErrorCode == codeInsufficient),
		errors.Is(err, nats.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return backPressureError{err}
	case errors.Is(err, nats.ErrNoStreamResponse), errors.Is(err, nats.ErrNoResponders):
		return unroutableError{err}
	}
	return err
}

// backPressureError is a publish error that is the server pushing back,
// not the message's fault: outbox.Relay never counts it against a row.
type backPressureError struct{ err error }

func (e backPressureError) Error() string { return e.err.Error() }
func (e backPressureError) Unwrap() error { return e.err }

// BackPressure reports true.
func (backPressureError) BackPressure() bool { return true }

// unroutableError is a publish error that says no stream takes the
// subject yet: outbox.Relay keeps the row until one does.
type unroutableError struct{ err error }

func (e unroutableError) Error() string { return e.err.Error() }
func (e unroutableError) Unwrap() error { return e.err }

// Unroutable reports true.
func (unroutableError) Unroutable() bool { return true }

// connect opens a NATS connection to url and its JetStream context.
func connect(url string, opts []nats.Option) (*nats.Conn, nats.JetStreamContext, error) {
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("jetstream: connect: %w", err)
	}
	js, err := nc.JetStream()
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return nc, js, nil
}
