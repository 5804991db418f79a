// Package amqp holds the RabbitMQ (AMQP 0-9-1) parts of the library that
// need amqp091-go; the transport-neutral core never imports it.
package amqp

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// DefaultConfirmTimeout bounds the wait for the broker's confirm of one
// message (ConfirmedPublisherConfig.ConfirmTimeout).
const DefaultConfirmTimeout = 10 * time.Second

// ErrUnroutable: the broker returned a message (basic.return) because no
// queue is bound for it (a dead-letter queue or a consumer's queue not
// declared yet), or closed the channel on its publish with 404 NOT_FOUND
// (the exchange does not exist) or 403 ACCESS_REFUSED (the user may not
// publish to it): nothing routes it until the topology or the permissions
// are fixed. The message was not stored: the chain keeps the original
// and retries, the relay keeps the row. It has an Unroutable method
// returning true, which outbox.Relay reads: a relay publishing through a
// ConfirmedPublisher never counts it against a row nor dead-letters the
// row; it keeps the row (holding back its topic's later rows) and warns.
var ErrUnroutable error = unroutableError("amqp: message unroutable")

// unroutableError is an error that tells whoever retries it that nothing
// routes the message yet (no queue bound, no such exchange, no permission).
type unroutableError string

func (e unroutableError) Error() string { return string(e) }

// Unroutable reports true.
func (unroutableError) Unroutable() bool { return true }

// ErrNotConfirmed: the broker nacked a message (basic.nack: a queue at its
// x-max-length or x-max-length-bytes with x-overflow reject-publish, an
// internal error), or the channel closed before it confirmed it. It is
// back-pressure, not the message's fault: it has a BackPressure method
// returning true, which outbox.Relay reads (a relay publishing through a
// ConfirmedPublisher never counts it against a row). A message that can
// never fit its queue is not ErrNotConfirmed (see errRefused).
var ErrNotConfirmed error = backPressureError("amqp: message not confirmed by the broker")

// errRefused: the broker refused the message itself, a refusal that every
// attempt meets again: it closed the channel (or the connection) with 501
// FRAME_ERROR (headers larger than the negotiated frame_max, 128 KiB by
// default on RabbitMQ) or 406 PRECONDITION_FAILED (a message over
// max_message_size), wrapping the broker's *amqp091.Error; or, on the
// default exchange, the topic's queue nacked it while holding no ready
// message (a body over its x-max-length-bytes: see nacked). Unlike
// ErrNotConfirmed it is not back-pressure: outbox.Relay counts it against
// the row, which is dead-lettered after RelayConfig.MaxAttempts instead of
// holding its topic back for good.
var errRefused = errors.New("amqp: message refused by the broker")

// backPressureError is an error that tells whoever retries it that the
// broker pushed back.
type backPressureError string

func (e backPressureError) Error() string { return string(e) }

// BackPressure reports true.
func (backPressureError) BackPressure() bool { return true }

// ConfirmedPublisherConfig configures NewConfirmedPublisher.
type ConfirmedPublisherConfig struct {
	// URL is the broker's AMQP URL ("amqp://guest:guest@127.0.0.1:5672/").
	// Required.
	URL string

	// Exchange is the exchange published to; the topic is the routing key.
	// Defaults to "" (the default exchange: the topic names the queue, as
	// watermill-amqp's NewDurableQueueConfig does). Only there does the
	// publisher know the queue, and so tell a message larger than its
	// queue's x-max-length-bytes (never fits) from a full queue
	// (back-pressure); through a named exchange every nack is
	// back-pressure.
	Exchange string

	// Marshaler turns messages into publishings. Defaults to
	// Marshaler{} (which publishes malformed messages verbatim).
	Marshaler interface {
		Marshal(*message.Message) (amqp091.Publishing, error)
	}

	// ConfirmTimeout bounds the wait for the broker's confirm of one
	// message. Defaults to DefaultConfirmTimeout.
	ConfirmTimeout time.Duration
}

// Validate reports the first invalid field of c, naming it.
func (c ConfirmedPublisherConfig) Validate() error {
	if c.URL == "" {
		return errors.New("amqp: ConfirmedPublisherConfig.URL is required")
	}
	if c.ConfirmTimeout < 0 {
		return fmt.Errorf("amqp: ConfirmedPublisherConfig.ConfirmTimeout %s: must be ≥ 0", c.ConfirmTimeout)
	}
	return nil
}

// ConfirmedPublisher is a message.Publisher for the poison (dead-letter) topic
// of middleware.PoisonConfig and for the outbox relay (outbox.NewRelay): a
// message no queue takes is an error, never a silent success, so the relay
// keeps the row (never counted against it) until the consumer's queue is
// bound; an unroutable probe shows the relay the broker up.
// Publish returns nil only once the broker has
// confirmed every message (publisher confirms) and routed it to a queue
// (mandatory: an unroutable message comes back as basic.return, which is
// ErrUnroutable, not success). watermill-amqp v3's Publisher, even with
// ConfirmDelivery and Mandatory, never reads basic.return, so a poison
// message to a missing queue is confirmed and silently dropped.
//
// One connection and channel, opened on first use and reopened after any
// failure (the broker down, the channel closed); publishes are serialised.
// Every wait of a Publish ends with its message's context: the turn behind
// another publish, the dial and handshake (at most 30 s, amqp091's
// default; one dial at a time), the write (the connection is closed when
// the context ends), the confirm (ConfirmTimeout); a broken connection is
// closed in the background. Errors are returned, never retried here: the
// chain retries with backoff.
type ConfirmedPublisher struct {
	cfg    ConfirmedPublisherConfig
	logger watermill.LoggerAdapter

	turn    chan struct{} // one slot: the publish (or Close) in progress
	dialing chan opened   // the dial in progress, when a publish gave up waiting for it
	conn    *amqp091.Connection
	ch      *amqp091.Channel
	returns chan amqp091.Return
	closes  chan *amqp091.Error // the broker's reason when it closes the channel
	closed  bool
}

// NewConfirmedPublisher validates cfg (defaults on a copy) and returns the
// publisher; it connects on the first Publish. A nil logger is
// watermill.NopLogger.
func NewConfirmedPublisher(cfg ConfirmedPublisherConfig, logger watermill.LoggerAdapter) (*ConfirmedPublisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Marshaler == nil {
		cfg.Marshaler = Marshaler{}
	}
	if cfg.ConfirmTimeout == 0 {
		cfg.ConfirmTimeout = DefaultConfirmTimeout
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &ConfirmedPublisher{cfg: cfg, logger: logger, turn: make(chan struct{}, 1)}, nil
}

var _ message.Publisher = (*ConfirmedPublisher)(nil)

// Publish publishes msgs to topic (the routing key), mandatory and
// persistent as the marshaler sets it, and waits for each confirm. It
// returns an error wrapping ErrUnroutable, ErrNotConfirmed, the broker's
// refusal of the message itself (not back-pressure: a channel closed with
// 501 FRAME_ERROR or 406 PRECONDITION_FAILED, or a nack by the topic's
// queue while it held nothing, on the default exchange), a connection or
// marshal error, or the context's error (msg.Context()); the channel is
// then reopened on the next call.
func (p *ConfirmedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	select {
	case p.turn <- struct{}{}:
	case <-msgs[0].Context().Done():
		return fmt.Errorf("amqp: publish of %s to %q (exchange %q): waiting for the publish in progress: %w", msgs[0].UUID, topic, p.cfg.Exchange, msgs[0].Context().Err())
	}
	defer func() { <-p.turn }()
	if p.closed {
		return errors.New("amqp: confirmed publisher closed")
	}
	for _, msg := range msgs {
		if err := p.publishOne(topic, msg); err != nil {
			p.reset()
			return fmt.Errorf("amqp: publish of %s to %q (exchange %q): %w", msg.UUID, topic, p.cfg.Exchange, err)
		}
	}
	return nil
}

func (p *ConfirmedPublisher) publishOne(topic string, msg *message.Message) error {
	pub, err := p.cfg.Marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("marshal: %w", err)
	}
	if err := p.open(msg.Context()); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(msg.Context(), p.cfg.ConfirmTimeout)
	defer cancel()
	if err := p.send(ctx, topic, pub); err != errNacked {
		return err
	}
	return p.nacked(ctx, topic, pub)
}

// errNacked is send's report of a basic.nack on a channel still open;
// publishOne turns it into ErrNotConfirmed or errRefused (nacked).
var errNacked = errors.New("amqp: nacked")

// send publishes pub to topic (mandatory) and waits for its confirm: nil
// once the broker has confirmed and routed it, errNacked for a nack on a
// channel still open, else the failure (ErrUnroutable, the channel's
// close, the context's end).
func (p *ConfirmedPublisher) send(ctx context.Context, topic string, pub amqp091.Publishing) error {
	// amqp091 looks at ctx only before it writes, and a broker that stops
	// reading (a memory or disk alarm, a stalled network) blocks the write
	// for good, holding the channel's lock, which its own heartbeat
	// timeout then waits for too. Closing the connection when ctx ends
	// (CloseDeadline sets the socket's deadline first) fails the write.
	conn := p.conn
	stop := context.AfterFunc(ctx, func() { _ = conn.CloseDeadline(time.Now()) })
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, p.cfg.Exchange, topic, true, false, pub)
	stop()
	if cerr := ctx.Err(); err != nil && cerr != nil {
		return fmt.Errorf("write: %w", cerr)
	}
	if errors.Is(err, amqp091.ErrClosed) {
		// The broker closed the channel or the connection while the
		// message was written (a frame over frame_max: 501 closes the
		// connection at once): its reason, not amqp091's 504.
		return p.channelClosed(ctx)
	}
	if err != nil {
		return err
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	// RabbitMQ sends basic.return before the basic.ack of an unroutable
	// mandatory message, and amqp091 dispatches both in order from one
	// reader, so a return is in the buffered channel by now.
	select {
	case r, ok := <-p.returns:
		if !ok {
			return p.channelClosed(ctx)
		}
		return fmt.Errorf("%w: %d %s (exchange %q, routing key %q)", ErrUnroutable, r.ReplyCode, r.ReplyText, r.Exchange, r.RoutingKey)
	default:
	}
	if !acked {
		if p.ch.IsClosed() {
			return p.channelClosed(ctx)
		}
		return errNacked
	}
	return nil
}

// nacked is the outcome of pub, which the broker nacked on an open
// channel: ErrNotConfirmed (back-pressure: a queue at its limit with
// x-overflow reject-publish waits for its consumer, however long that
// takes), or errRefused when the message can never fit its queue.
//
// Why "the queue holds nothing" and not a time bound: a classic queue
// counts only its ready messages against x-max-length and
// x-max-length-bytes, and with reject-publish refuses a message that would
// take it past them. So a queue that holds no ready message and refuses
// the message refuses it for the message alone (a body over
// x-max-length-bytes, or x-max-length 0): no consumer will ever make room
// for it, and a relay that waits for room wedges its topic for good. A
// queue that holds something may take it once drained, however long its
// consumer is away: back-pressure. A time bound cannot tell the two
// apart; it would dead-letter the rows of a long consumer outage. (A
// quorum queue checks its limits before an enqueue: an empty one takes a
// message of any size, so an oversized one never wedges it. A classic
// queue that nacks every message while empty for another reason, an
// internal error of its process, is judged the same way.)
//
// How: only on the default exchange (Exchange ""), which routes topic to
// the queue named topic and to no other. An AMQP 0-9-1 client cannot list
// the queues a named exchange routes to, so there every nack stays
// back-pressure. The queue's ready count (a passive declare) is a snapshot:
// a consumer may have drained a full queue between the nack and the look.
// So an empty look is followed by a second publish, which such a queue
// takes (success), and a second look; only a queue seen empty on both
// sides of a second nack makes the message one that can never fit.
// Whatever cannot be read (the declare fails, the context ends) leaves
// the nack back-pressure. The relay counts errRefused against the row
// like any refusal of the row's own (dead-lettered after
// RelayConfig.MaxAttempts while its probe goes through), not at once: a
// misjudged attempt would have to repeat MaxAttempts times to set a row
// aside, and a limit raised meanwhile lets the row through.
func (p *ConfirmedPublisher) nacked(ctx context.Context, topic string, pub amqp091.Publishing) error {
	if p.cfg.Exchange != "" || !p.queueEmpty(ctx, topic) {
		return ErrNotConfirmed
	}
	if err := p.send(ctx, topic, pub); err != errNacked {
		return err // taken now that the queue has room, or another failure
	}
	if !p.queueEmpty(ctx, topic) {
		return ErrNotConfirmed
	}
	return fmt.Errorf("%w: queue %q nacked it while it held no ready message, twice: the message is larger than the queue's x-max-length-bytes (x-overflow reject-publish) and can never fit", errRefused, topic)
}

// queueEmpty reports whether queue exists and holds no ready message, by a
// passive declare on a channel of its own (a failed declare closes its
// channel). False when the answer cannot be had before ctx ends; the
// declare left behind ends when Publish, which failed, closes the
// connection.
func (p *ConfirmedPublisher) queueEmpty(ctx context.Context, queue string) bool {
	conn := p.conn
	empty := make(chan bool, 1)
	go func() {
		ch, err := conn.Channel()
		if err != nil {
			empty <- false
			return
		}
		defer ch.Close()
		q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
		empty <- err == nil && q.Messages == 0
	}()
	select {
	case e := <-empty:
		return e
	case <-ctx.Done():
		return false
	}
}

// channelClosed is the error of a publish whose channel closed before it
// was confirmed: ErrNotConfirmed, with the broker's reason when the broker
// closed it; ErrUnroutable when the broker refused the exchange (404
// NOT_FOUND: it does not exist; 403 ACCESS_REFUSED), a misconfiguration
// named with the broker's reason; or errRefused when that reason is the
// message's own (refusedByBroker). It
// waits for the channel's close notification (until ctx ends): amqp091
// marks a channel closed before it delivers the reason, and closes the
// notification channel once it did, so the wait is short.
func (p *ConfirmedPublisher) channelClosed(ctx context.Context) error {
	select {
	case e, ok := <-p.closes:
		if ok && e != nil {
			if refusedByBroker(e) {
				return fmt.Errorf("%w: channel closed by the broker: %w", errRefused, e)
			}
			if e.Code == amqp091.NotFound || e.Code == amqp091.AccessRefused {
				// The exchange, not the broker's load: a wait, but a
				// visible one (outbox.Relay warns for an unroutable row,
				// where back-pressure is logged at INFO).
				return fmt.Errorf("%w: the broker refused the exchange: %w", ErrUnroutable, e)
			}
			return fmt.Errorf("%w: channel closed by the broker: %w", ErrNotConfirmed, e)
		}
	case <-ctx.Done():
	}
	return fmt.Errorf("%w: channel closed", ErrNotConfirmed)
}

// refusedByBroker reports whether the broker closed the channel or the
// connection because of the message published (errRefused): 501
// FRAME_ERROR (a frame over frame_max: the message's headers) or 406
// PRECONDITION_FAILED (a message over max_message_size). A publish-only
// channel declares nothing, so these codes come from the message. Only
// when the broker sent them (Server): amqp091 reports a connection lost
// under it, a read or write failing (EOF, a reset), as a 501 of its own
// (Server false), which is an outage, never the message's fault.
func refusedByBroker(e *amqp091.Error) bool {
	return e.Server && (e.Code == amqp091.FrameError || e.Code == amqp091.PreconditionFailed)
}

// handshakeTimeout bounds the TCP connect and the AMQP handshake of a
// dial, as amqp091.Dial's default does.
const handshakeTimeout = 30 * time.Second

// closeTimeout bounds the close handshake of a connection given up.
const closeTimeout = 5 * time.Second

// opened is the outcome of a dial (dialConfirmMode).
type opened struct {
	conn *amqp091.Connection
	ch   *amqp091.Channel
	err  error
}

// open (re)connects and opens a confirm-mode channel, or returns ctx's
// error when ctx ends first. One dial at a time: a dial whose publish gave
// up goes on in the background (bounded by handshakeTimeout) and the next
// open waits for it instead of starting another, so a broker that stops
// answering costs one pending connection, not one per retry.
func (p *ConfirmedPublisher) open(ctx context.Context) error {
	if p.ch != nil && !p.ch.IsClosed() && p.conn != nil && !p.conn.IsClosed() {
		return nil
	}
	p.reset()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	if p.dialing == nil {
		d := make(chan opened, 1)
		url := p.cfg.URL
		go func() {
			conn, ch, err := dialConfirmMode(url)
			d <- opened{conn, ch, err}
		}()
		p.dialing = d
	}
	var o opened
	select {
	case o = <-p.dialing:
		p.dialing = nil
	case <-ctx.Done():
		return fmt.Errorf("dial: %w", ctx.Err())
	}
	if o.err != nil {
		return o.err
	}
	// One publish in flight at a time, so one return at most between two
	// confirms; a larger buffer only guards against a stray one.
	p.returns = o.ch.NotifyReturn(make(chan amqp091.Return, 8))
	p.closes = o.ch.NotifyClose(make(chan *amqp091.Error, 1))
	p.conn, p.ch = o.conn, o.ch
	return nil
}

// dialConfirmMode connects to url and opens a confirm-mode channel, within
// handshakeTimeout until the connection is open; the channel's opening
// after it is bounded by the connection's heartbeat (amqp091's 10 s).
func dialConfirmMode(url string) (*amqp091.Connection, *amqp091.Channel, error) {
	conn, err := amqp091.DialConfig(url, amqp091.Config{
		Heartbeat: 10 * time.Second, Locale: "en_US",
		Dial: amqp091.DefaultDial(handshakeTimeout),
	})
	if err != nil {
		return nil, nil, fmt.Errorf("dial: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		closeConn(conn)
		return nil, nil, fmt.Errorf("channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		closeConn(conn)
		return nil, nil, fmt.Errorf("confirm mode: %w", err)
	}
	return conn, ch, nil
}

// reset forgets the connection and closes it in the background (a broken
// or silent broker may never answer the close: closeConn bounds it).
func (p *ConfirmedPublisher) reset() {
	if conn := p.forget(); conn != nil {
		go closeConn(conn)
	}
}

// forget clears the connection, its channel and their notifications, and
// returns the connection (nil: none).
func (p *ConfirmedPublisher) forget() *amqp091.Connection {
	conn := p.conn
	p.conn, p.ch, p.returns, p.closes = nil, nil, nil, nil
	return conn
}

// closeConn closes conn, waiting at most closeTimeout for the broker's
// answer.
func closeConn(conn *amqp091.Connection) {
	_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
}

// Close closes the connection (waiting for a publish in progress, which
// its context bounds) and, in the background, the connection of a dial
// still pending; later publishes fail.
func (p *ConfirmedPublisher) Close() error {
	p.turn <- struct{}{}
	defer func() { <-p.turn }()
	p.closed = true
	if conn := p.forget(); conn != nil {
		closeConn(conn)
	}
	if d := p.dialing; d != nil {
		p.dialing = nil
		go func() {
			if o := <-d; o.conn != nil {
				closeConn(o.conn)
			}
		}()
	}
	return nil
}
