package versioned

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// LatestPublisherConfig configures a LatestPublisher.
type LatestPublisherConfig struct {
	// Store records the latest position of each family: a *FamilyStore
	// (PostgreSQL, MySQL or SQLite) or a *redislatest.Store (module versioned/redislatest). Required.
	Store LatestStore

	// Tx is the producer's transaction, for a Transactional store
	// (idempotency.PgxTx(tx), idempotency.SQLTx(tx)): the record commits or rolls back with
	// the outbox rows the inner publisher writes in that transaction.
	// Required for a Transactional store (a pool is accepted when the inner
	// publisher sends to the broker directly: the record is then written
	// after the broker accepted the message). Ignored by other stores.
	Tx idempotency.Tx

	// Deferred, for a store that is not Transactional (Redis), holds the
	// records back until Flush. Set it whenever the inner publisher writes
	// into a transaction (an outbox), and call Flush after that transaction
	// commits: recorded before the commit, a rollback would leave a record
	// naming a message that does not exist, and the family's real latest
	// message, older than it, would be dropped. Forgetting Flush, or a crash
	// before it, only leaves the family unfiltered. Without Deferred the
	// record is written as soon as the inner Publish returns nil (right for
	// a publisher that sends to the broker). Refused with a Transactional
	// store, which needs no deferral.
	Deferred bool
}

// Validate reports the first invalid field of c, naming it.
func (c LatestPublisherConfig) Validate() error {
	switch {
	case c.Store == nil:
		return errors.New("versioned: LatestPublisherConfig.Store is required")
	case c.Store.Transactional() && !hasTx(c.Tx):
		return errors.New("versioned: LatestPublisherConfig.Tx is required with a transactional store (the producer's transaction)")
	case c.Store.Transactional() && c.Deferred:
		return errors.New("versioned: LatestPublisherConfig.Deferred: only for stores that are not transactional (Redis)")
	}
	return nil
}

// LatestPublisher is a message.Publisher decorator for producers: it
// publishes through the inner publisher and records, for each family among
// the messages (FamilyOf), the newest position published, as an Advance that
// never moves backwards. Build one per producer transaction, typically around
// the outbox publisher of that transaction:
//
//	pub, _ := ob.PgxPublisher(tx)
//	lp, _ := versioned.NewLatestPublisher(pub, versioned.LatestPublisherConfig{
//		Store: families, Tx: idempotency.PgxTx(tx)}, logger)
//	_ = versioned.SetFamilySeq(msg, versioned.Family{Kind: "catalogue.product", ID: sku}, version)
//	err = lp.Publish(topic, msg) // outbox row and latest record, one transaction
//
// Messages without family metadata are published untouched. A message with
// invalid family metadata fails the whole Publish (ErrFamilyInvalid) before
// anything is published. Within one Publish call, families are advanced in
// (kind, id) order, so two producers publishing the same families in one
// call each cannot deadlock on the latest rows; across calls in one
// transaction the order is the caller's.
//
// Errors of a Transactional store are returned (the transaction must roll
// back). Errors of another store, when not Deferred, are logged and not
// returned: the message is already out, a missing record only leaves the
// family unfiltered, and returning an error could make the caller publish
// again. Safe for concurrent use, although a transaction usually is not.
type LatestPublisher struct {
	inner  message.Publisher
	cfg    LatestPublisherConfig
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	pending map[Family]Position // Deferred: held back until Flush
}

// pendingLatest is a position to record and the context to record it on.
type pendingLatest struct {
	pos Position
	ctx context.Context
}

var _ message.Publisher = (*LatestPublisher)(nil)

// NewLatestPublisher validates cfg and wraps inner. A nil logger is
// watermill.NopLogger.
func NewLatestPublisher(inner message.Publisher, cfg LatestPublisherConfig, logger watermill.LoggerAdapter) (*LatestPublisher, error) {
	if inner == nil {
		return nil, errors.New("versioned: NewLatestPublisher: inner publisher is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &LatestPublisher{inner: inner, cfg: cfg, logger: logger, pending: map[Family]Position{}}, nil
}

// Publish validates every message's family metadata, publishes msgs through
// the inner publisher and, when that succeeded, records the newest position
// of each family among them (or, Deferred, keeps it for Flush). Each record
// uses the context of the message that carries the position.
func (p *LatestPublisher) Publish(topic string, msgs ...*message.Message) error {
	newest := map[Family]pendingLatest{}
	for _, msg := range msgs {
		f, pos, ok, err := FamilyOf(msg)
		if err != nil {
			return fmt.Errorf("versioned: publish %s to %s: %w", msgUUID(msg), topic, err)
		}
		if !ok {
			continue
		}
		if cur, seen := newest[f]; !seen || pos.After(cur.pos) {
			newest[f] = pendingLatest{pos: pos, ctx: msg.Context()}
		}
	}
	if err := p.inner.Publish(topic, msgs...); err != nil {
		return err
	}
	if len(newest) == 0 {
		return nil
	}
	if p.cfg.Deferred {
		p.mu.Lock()
		for f, n := range newest {
			if cur, seen := p.pending[f]; !seen || n.pos.After(cur) {
				p.pending[f] = n.pos
			}
		}
		p.mu.Unlock()
		return nil
	}
	err := p.advance(newest)
	if err != nil && !p.cfg.Store.Transactional() {
		p.logger.Error("Latest-per-family record not written; the family stays unfiltered until its next message", err, watermill.LogFields{"topic": topic})
		return nil
	}
	return err
}

// Flush writes the records held back by a Deferred publisher (call it after
// the producer's transaction committed) and forgets them, also on error. It
// returns the joined errors of the records that failed; ignoring them is
// safe: those families are only left unfiltered. Without Deferred it does
// nothing.
func (p *LatestPublisher) Flush(ctx context.Context) error {
	p.mu.Lock()
	held := p.pending
	p.pending = map[Family]Position{}
	p.mu.Unlock()
	pending := make(map[Family]pendingLatest, len(held))
	for f, pos := range held {
		pending[f] = pendingLatest{pos: pos, ctx: ctx}
	}
	return p.advance(pending)
}

// Discard forgets the records held back by a Deferred publisher (call it
// when the producer's transaction rolled back). Flush after Discard writes
// nothing.
func (p *LatestPublisher) Discard() {
	p.mu.Lock()
	p.pending = map[Family]Position{}
	p.mu.Unlock()
}

// Close closes the inner publisher.
func (p *LatestPublisher) Close() error { return p.inner.Close() }

// advance records each family's position, in (kind, id) order.
func (p *LatestPublisher) advance(newest map[Family]pendingLatest) error {
	fams := make([]Family, 0, len(newest))
	for f := range newest {
		fams = append(fams, f)
	}
	sort.Slice(fams, func(i, j int) bool {
		if fams[i].Kind != fams[j].Kind {
			return fams[i].Kind < fams[j].Kind
		}
		return fams[i].ID < fams[j].ID
	})
	var errs []error
	for _, f := range fams {
		n := newest[f]
		q, _ := sqldb.TxOf(p.cfg.Tx)
		if _, err := p.cfg.Store.Advance(n.ctx, q, f, n.pos); err != nil {
			errs = append(errs, err)
			if p.cfg.Store.Transactional() {
				break // the transaction is aborted: nothing more can run in it
			}
		}
	}
	return errors.Join(errs...)
}

func msgUUID(msg *message.Message) string {
	if msg == nil {
		return "<nil message>"
	}
	return msg.UUID
}

// hasTx reports whether tx is set (not the zero Tx).
func hasTx(tx idempotency.Tx) bool {
	_, err := sqldb.TxOf(tx)
	return err == nil
}
