package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/examples/indexer"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// The demo's fault injectors. Each reproduces one way at-least-once delivery
// shows up in production; none touches the shared services.

// lockedRand is a seeded source shared by goroutines.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newLockedRand(seed uint64) *lockedRand {
	return &lockedRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (l *lockedRand) chance(p float64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64() < p
}

func (l *lockedRand) intN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

// flakyConfirms sits between a relay and the broker and, for a share of
// publishes, reports a failure after the broker took the message: a relay
// whose confirm was lost (or that crashed before deleting the row). The relay
// keeps the row and publishes it again later, with the same event id. It
// never fails two publishes in a row, so the relay always progresses.
type flakyConfirms struct {
	message.Publisher // toward the broker
	share             float64
	rng               *lockedRand

	mu          sync.Mutex
	lastFailed  bool
	republished atomic.Int64 // rows published again
}

// errConfirmLost is the failure flakyConfirms reports.
var errConfirmLost = errors.New("demo: fault: confirm lost after the broker took the message")

func (f *flakyConfirms) Publish(topic string, msgs ...*message.Message) error {
	if err := f.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	f.mu.Lock()
	fail := !f.lastFailed && f.rng.chance(f.share)
	f.lastFailed = fail
	f.mu.Unlock()
	if !fail {
		return nil
	}
	f.republished.Add(int64(len(msgs)))
	return errConfirmLost
}

// newFlakyConfirms wraps a relay's destination.
func (d *demo) newFlakyConfirms(inner message.Publisher) *flakyConfirms {
	return &flakyConfirms{Publisher: inner, share: d.cfg.RelayFail, rng: d.rng}
}

// relayConfig is the outbox relay tuning of the demo: short waits, so that a
// run is quick; many attempts, so that the injected confirm losses never
// dead-letter a row.
var relayConfig = outbox.RelayConfig{
	PollInterval:  20 * time.Millisecond,
	RetryInterval: 20 * time.Millisecond,
	MaxBackoff:    200 * time.Millisecond,
	MaxAttempts:   1000,
	Retention:     time.Hour,
}

// holdOpenTransaction is the "open transaction elsewhere" fault: a session
// on another database of the same PostgreSQL server runs BEGIN; SELECT
// pg_current_xact_id(); and stays open for the whole run. The outbox relays
// must not wait for it (they claim rows, they do not read below the
// server's oldest open transaction).
func (d *demo) holdOpenTransaction(ctx context.Context) error {
	u, err := url.Parse(d.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("open-tx fault: %w", err)
	}
	u.Path = "/postgres"
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("open-tx fault: connect to database postgres: %w", err)
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`)
	}
	if err != nil {
		_ = conn.Close(ctx)
		return fmt.Errorf("open-tx fault: %w", err)
	}
	d.defer_(func() {
		_ = tx.Rollback(context.Background())
		_ = conn.Close(context.Background())
	})
	return nil
}

// reorderingPublisher sits between a relay and the broker and, for a share
// of the entities of one topic (orders, products), holds back a versioned
// message until a later version of the same entity has been published, then
// publishes it: the consumer receives v3 before v2, as when two relays, a
// retry or a replay overtake each other. Only versions below finalVersion
// are held, so every held message has a later one to wait for. Held
// messages live in memory: the demo flushes them before it checks.
type reorderingPublisher struct {
	message.Publisher
	topic        string
	version      func(*message.Message) (entity string, version int64, ok bool)
	share        float64
	finalVersion int64
	rng          *lockedRand

	mu        sync.Mutex
	held      map[string]heldMessage // entity → held message
	reordered atomic.Int64
}

type heldMessage struct {
	version int64
	msg     *message.Message
}

var _ message.Publisher = (*reorderingPublisher)(nil)

// statusVersion is the entity and version of an order status change.
func statusVersion(m *message.Message) (string, int64, bool) {
	var ev shop.OrderStatusChanged
	if err := json.Unmarshal(m.Payload, &ev); err != nil {
		return "", 0, false
	}
	return ev.OrderID, ev.Version, true
}

// productVersion is the entity and version of a product update.
func productVersion(m *message.Message) (string, int64, bool) {
	var ev indexer.ProductUpdated
	if err := json.Unmarshal(m.Payload, &ev); err != nil {
		return "", 0, false
	}
	return ev.SKU, ev.Version, true
}

func (p *reorderingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := p.publishOne(topic, m); err != nil {
			return err
		}
	}
	return nil
}

func (p *reorderingPublisher) publishOne(topic string, m *message.Message) error {
	if topic != p.topic {
		return p.Publisher.Publish(topic, m)
	}
	entity, version, ok := p.version(m)
	if !ok {
		return p.Publisher.Publish(topic, m)
	}
	p.mu.Lock()
	h, holding := p.held[entity]
	switch {
	case holding && h.msg.UUID == m.UUID:
		// The relay republished the held message: it is still held.
		p.mu.Unlock()
		return nil
	case holding && version > h.version:
		delete(p.held, entity)
		p.mu.Unlock()
		if err := p.Publisher.Publish(topic, m); err != nil {
			p.hold(entity, h)
			return err
		}
		if err := p.Publisher.Publish(topic, h.msg); err != nil {
			// The newer one went out; publish the held one with the next call.
			p.hold(entity, h)
			return err
		}
		p.reordered.Add(1)
		return nil
	case !holding && version < p.finalVersion && p.rng.chance(p.share):
		p.held[entity] = heldMessage{version: version, msg: m.Copy()}
		p.mu.Unlock()
		return nil
	}
	p.mu.Unlock()
	return p.Publisher.Publish(topic, m)
}

func (p *reorderingPublisher) hold(entity string, h heldMessage) {
	p.mu.Lock()
	p.held[entity] = h
	p.mu.Unlock()
}

// flush publishes every message still held, in no particular order.
func (p *reorderingPublisher) flush() error {
	p.mu.Lock()
	held := p.held
	p.held = map[string]heldMessage{}
	p.mu.Unlock()
	for entity, h := range held {
		if err := p.Publisher.Publish(p.topic, h.msg); err != nil {
			p.hold(entity, h)
			return err
		}
	}
	return nil
}

func (p *reorderingPublisher) heldCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.held)
}

// consumerProbe is the outermost middleware of a consumer service: it counts
// deliveries and deliveries in flight, and after every cutEvery-th delivery
// whose handler committed it cuts the consumer's AMQP connection (through
// the fault proxy; embedded, the in-process broker forgets the connection's
// unacked deliveries the same way) before the router acks: the ack is lost and the broker
// redelivers the message with redelivered=true, which the claim must absorb.
type consumerProbe struct {
	name     string
	cut      func() // loses the acks of the consumer's deliveries in flight
	cutEvery int64
	// ackWaitRedelivers is set when the broker also redelivers a message
	// whose ack did not reach it within a deadline on the same connection
	// (JetStream's AckWait): a delivery waiting in the client behind slower
	// ones is sent again although the connection lived.
	ackWaitRedelivers bool

	deliveries  atomic.Int64
	redelivered atomic.Int64
	inFlight    atomic.Int64
	commits     atomic.Int64
	cuts        atomic.Int64
	lastSeen    atomic.Int64 // unix nanos of the last delivery's end

	mu       sync.Mutex
	awaiting map[string]bool                // event ids whose ack was cut, until redelivered
	perID    map[string][]malformedDelivery // malformed message UUID → each of its deliveries
}

// malformedDelivery is one delivery of a malformed message: the broker
// connection (session) it came on and whether the router acked it.
type malformedDelivery struct {
	session uint64
	acked   bool
}

type attemptKey struct{}

// attempt is shared, through the message context, between the probe and
// the handler wrapper inside the consumer's claim.
type attempt struct{ committed atomic.Bool }

func (p *consumerProbe) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		p.inFlight.Add(1)
		p.deliveries.Add(1)
		defer func() {
			p.lastSeen.Store(nowNanos())
			p.inFlight.Add(-1)
		}()
		if marshaler.Redelivered(msg) {
			p.redelivered.Add(1)
		}
		id := msg.UUID // inner middleware may rewrite it (-id-at-reception)
		_, malformed := marshaler.Malformed(msg)
		p.mu.Lock()
		delete(p.awaiting, id)
		p.mu.Unlock()

		a := &attempt{}
		msg.SetContext(context.WithValue(msg.Context(), attemptKey{}, a))
		out, err := h(msg)
		if malformed {
			session, _ := shop.SessionFromContext(msg.Context())
			p.mu.Lock()
			p.perID[id] = append(p.perID[id], malformedDelivery{session: session, acked: err == nil})
			p.mu.Unlock()
		}
		if err == nil && a.committed.Load() {
			n := p.commits.Add(1)
			if p.cutEvery > 0 && n%p.cutEvery == 0 {
				p.mu.Lock()
				p.awaiting[id] = true
				p.mu.Unlock()
				p.cut() // the router's ack now cannot reach the broker
				p.cuts.Add(1)
			}
		}
		return out, err
	}
}

// handler wraps the service handler: a nil error means the middleware is
// about to commit (a failed commit returns an error to the probe).
func (p *consumerProbe) handler(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if a, ok := msg.Context().Value(attemptKey{}).(*attempt); ok && err == nil {
			a.committed.Store(true)
		}
		return out, err
	}
}

// malformedDeliveries returns how many times the malformed message id was
// delivered, and how many of its deliveries after the first the broker
// explains by an ack that did not reach it:
//   - the delivery came on another connection than the previous one: that
//     connection was lost before the ack reached the broker. A cut does that
//     to the delivery it follows, and also to a delivery handled just before
//     it whose ack was still on its way, or to one the client had already
//     received on the connection when it was cut;
//   - with ackWaitRedelivers, the previous delivery was acked: JetStream sent
//     the message again when AckWait ran out while that copy waited in the
//     client or its ack was on its way.
//
// Any other delivery on the same connection follows a nack: a requeue, the
// loop the dead-letter path exists to prevent.
func (p *consumerProbe) malformedDeliveries(id string) (deliveries, explained int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ds := p.perID[id]
	for i := 1; i < len(ds); i++ {
		if ds[i].session != ds[i-1].session || (p.ackWaitRedelivers && ds[i-1].acked) {
			explained++
		}
	}
	return len(ds), explained
}

func (p *consumerProbe) awaitingRedelivery() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.awaiting)
}

// idAtReception gives every delivery a fresh event id: the mistake the
// library's contract forbids (event ids are set by the producer, once). Used
// by -id-at-reception to show that the checks catch double effects.
func idAtReception(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if _, bad := marshaler.Malformed(msg); !bad {
			msg.UUID = uuid.Must(uuid.NewV7()).String() //idemvet:ignore the -id-at-reception fault shows what this mistake does
		}
		return h(msg)
	}
}
