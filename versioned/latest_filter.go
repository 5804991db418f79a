package versioned

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// filterOutcome is what the LatestFilter did with one attempt.
type filterOutcome string

const (
	// filterNoFamily: the message has no family metadata; the handler was
	// called, the filter did nothing else.
	filterNoFamily filterOutcome = "no_family"
	// filterHandled: the message is the newest of its family this consumer
	// has seen and no newer one is recorded; the handler was called, and its
	// position recorded as applied in the same transaction.
	filterHandled filterOutcome = "handled"
	// filterObsolete: a newer message of the family was published (the
	// latest record is newer): acked without calling the handler.
	filterObsolete filterOutcome = "obsolete"
	// filterStale: the consumer already applied this message or a newer one
	// of the family: acked without calling the handler.
	filterStale filterOutcome = "stale"
	// filterRejected: the family metadata is invalid, or the filter runs
	// outside the idempotent middleware; a permanent error was returned.
	filterRejected filterOutcome = "rejected"
	// filterFailed: the store failed; the error was returned (retried).
	filterFailed filterOutcome = "failed"
)

// filterObservation is one attempt's outcome.
type filterObservation struct {
	// Consumer is the consumer name the applied record is kept under.
	Consumer string
	// Family is the message's family (zero for filterNoFamily and some
	// filterRejected).
	Family Family
	// EventID is msg.UUID.
	EventID string
	// Outcome is what the filter did.
	Outcome filterOutcome
	// LatestUnknown is true when the latest record could not be read (a
	// non-transactional store failed) and the message was let through on
	// the applied check alone.
	LatestUnknown bool
}

// filterRecorder receives one filterObservation per attempt (metrics);
// implementations must be safe for concurrent use and fast.
type filterRecorder interface {
	RecordFilter(filterObservation)
}

// filterCounter is a filterRecorder that counts attempts per outcome. The
// zero value is ready to use; safe for concurrent use.
type filterCounter struct {
	noFamily, handled, obsolete, stale, rejected, failed, latestUnknown atomic.Int64
}

var _ filterRecorder = (*filterCounter)(nil)

// RecordFilter counts o.
func (c *filterCounter) RecordFilter(o filterObservation) {
	if n := c.counter(o.Outcome); n != nil {
		n.Add(1)
	}
	if o.LatestUnknown {
		c.latestUnknown.Add(1)
	}
}

// Count returns the number of attempts recorded with outcome o (0 for an
// unknown outcome).
func (c *filterCounter) Count(o filterOutcome) int64 {
	if n := c.counter(o); n != nil {
		return n.Load()
	}
	return 0
}

// LatestUnknown returns the number of attempts let through because the
// latest record could not be read.
func (c *filterCounter) LatestUnknown() int64 { return c.latestUnknown.Load() }

func (c *filterCounter) counter(o filterOutcome) *atomic.Int64 {
	switch o {
	case filterNoFamily:
		return &c.noFamily
	case filterHandled:
		return &c.handled
	case filterObsolete:
		return &c.obsolete
	case filterStale:
		return &c.stale
	case filterRejected:
		return &c.rejected
	case filterFailed:
		return &c.failed
	}
	return nil
}

// LatestFilterConfig configures a LatestFilter.
type LatestFilterConfig struct {
	// Families is the SQL family store (of the handler's database and
	// dialect): its applied table is written in the handler's transaction.
	// Required.
	Families *FamilyStore

	// Latest is where the producers' latest records are read. Defaults to
	// Families (read in the handler's transaction). Set a
	// *redislatest.Store (module versioned/redislatest) when producers record there.
	Latest LatestStore

	// LatestDB, when set, is where a Transactional Latest store is read
	// instead of the handler's transaction: a pool on the producers'
	// database when it is not the consumer's. Reads there are outside the
	// handler's transaction, so their errors are tolerated like Redis's.
	// Defaults to nil (read in the handler's transaction, in the same round
	// trip as the applied record).
	LatestDB idempotency.DB

	// Consumer names the consumer whose applied positions are recorded:
	// valid UTF-8 without NUL, at most MaxFamilyPartLen bytes (the family
	// tables' consumer column is VARBINARY(255) on MySQL), as Validate
	// checks. Defaults to the consumer the idempotent middleware claimed with
	// (the consumer attaching the filter), else the Watermill handler name of
	// the message's context. With none, every message with a family fails
	// with the permanent ErrNoConsumer.
	Consumer string

	// DisableMarkStale keeps the filter from calling middleware.MarkObsolete
	// (obsolete messages) and middleware.MarkStale (stale ones) for the
	// messages it skips. By default it does, so the idempotent middleware
	// records and logs them as OutcomeObsolete / OutcomeStale, at debug
	// level, like duplicates.
	DisableMarkStale bool

	// DisableRetireOnPoison opts out of retiring poisoned messages. By
	// default, when a message the filter let through to the handler is
	// about to be poisoned by the consumer's chain (after the retries),
	// its position is retired (on RetireDB, outside the failed
	// transaction): a latest record naming it
	// no longer makes older messages obsolete at this consumer, so a
	// poisoned newest message never freezes its family. One that keeps
	// killing the process is retired before its handler runs in the last
	// attempt the consumer's crash bound lets run (ConsumerConfig.MaxCrashes;
	// the delivery that dead-letters it as a crash loop never reaches the
	// filter; not on SQLite): see the package doc. If the retirement
	// fails, the message is held and retried, not poisoned. Opted out, a
	// poisoned newest message keeps every older message of its family
	// obsolete at this consumer (the family frozen there) until a newer one
	// is published.
	DisableRetireOnPoison bool

	// RetireDB is where poisoned messages are retired: the consumer's
	// database, where Families' tables are. Defaults to the consumer's own
	// DB (ConsumerConfig.DB).
	RetireDB idempotency.DB
}

// Validate reports the first invalid field of c, naming it.
func (c LatestFilterConfig) Validate() error {
	if c.Families == nil {
		return errors.New("versioned: LatestFilterConfig.Families is required (NewFamilyStore)")
	}
	// A name the family tables cannot hold failed every message of a family
	// on one database only (MySQL 1406 over 255 bytes; PostgreSQL 22021
	// for bytes that are not UTF-8 or NUL), and its retirement with it.
	switch n := c.Consumer; {
	case len(n) > MaxFamilyPartLen:
		return fmt.Errorf("versioned: LatestFilterConfig.Consumer: %d bytes, over %d", len(n), MaxFamilyPartLen)
	case !utf8.ValidString(n):
		return errors.New("versioned: LatestFilterConfig.Consumer: not valid UTF-8")
	case strings.IndexByte(n, 0) >= 0:
		return errors.New("versioned: LatestFilterConfig.Consumer: contains a NUL byte")
	}
	return nil
}

// LatestFilter is the consumer side of the latest-per-family filter. See
// Middleware. Safe for concurrent use.
type LatestFilter struct {
	cfg    LatestFilterConfig
	logger watermill.LoggerAdapter
	rec    filterRecorder // tests only (export_test.go)
	// oneTrip: the latest table is the applied table's store, read in the
	// handler's transaction: one statement gives the whole verdict.
	oneTrip bool
}

var _ message.HandlerMiddleware = (*LatestFilter)(nil).Middleware

// NewLatestFilter validates cfg (on a copy with defaults applied). A nil
// logger is watermill.NopLogger.
func NewLatestFilter(cfg LatestFilterConfig, logger watermill.LoggerAdapter) (*LatestFilter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Latest == nil {
		cfg.Latest = cfg.Families
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	same, _ := cfg.Latest.(*FamilyStore)
	return &LatestFilter{
		cfg:     cfg,
		logger:  logger,
		oneTrip: same == cfg.Families && !hasDB(cfg.LatestDB),
	}, nil
}

// Middleware returns the filter as a Watermill handler middleware. It must
// run inside the idempotent middleware's transaction, directly around the
// handler; the recommended chain, outermost first, is
//
//	PoisonQueue → Retry → Recoverer → Idempotent → LatestFilter → handler
//
// (add it with router.AddMiddleware after the chain of middleware.NewConsumer,
// or wrap the handler: filter.Middleware(handler)). Per attempt:
//
//  1. A message without family metadata goes to h untouched.
//  2. Invalid family metadata (ErrFamilyInvalid), no transaction in the
//     context (ErrNoTransaction) or no consumer name (ErrNoConsumer): a
//     permanent error; h is not called.
//  3. Obsolete: the latest record of the family is newer than the message.
//     h is not called and nil is returned: the idempotent middleware commits
//     its claim and the router acks. A redelivery is a duplicate, or
//     obsolete again.
//  4. Stale: the message is not newer than the last one this consumer
//     applied for the family (recorded in the applied table). h is not
//     called; nil is returned.
//  5. Otherwise the message's position is recorded as applied, in the
//     handler's transaction, and h is called. If h fails, the transaction
//     rolls back and the record with it, so a retry is not stale.
//
// Skipped messages (3, 4) are logged at debug level and marked (obsolete,
// stale) so that the consumer's Recorder counts them as
// middleware.OutcomeObsolete and middleware.OutcomeStale.
//
// With the family store read in the handler's transaction, steps 3-5 cost
// one statement on PostgreSQL, two (a read, then the applied upsert) on
// MySQL and SQLite. With a store that is not Transactional (Redis), or a
// LatestDB, the latest record is read first; if that read fails the
// failure is logged and the message is judged by the applied check alone
// (let through unless stale): the filter fails open, never dropping a
// message it cannot prove superseded.
//
// Concurrency: the applied row of (consumer, family) stays locked until the
// handler's transaction ends, so one consumer's handlers of one family run
// one at a time, the later waiting for the earlier to commit (bounded by the
// idempotent middleware's LockTimeout, after which the attempt fails
// transiently and is retried). Different families never wait for each other.
func (f *LatestFilter) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		fam, pos, ok, err := FamilyOf(msg)
		if err != nil {
			f.record(filterObservation{Family: fam, EventID: msg.UUID, Outcome: filterRejected})
			return nil, err
		}
		if !ok {
			f.record(filterObservation{EventID: msg.UUID, Outcome: filterNoFamily})
			return h(msg)
		}
		ctx := msg.Context()
		consumer := f.cfg.Consumer
		if consumer == "" {
			consumer, _ = inbox.ConsumerFromContext(ctx)
		}
		if consumer == "" {
			consumer = message.HandlerNameFromCtx(ctx)
		}
		obs := filterObservation{Consumer: consumer, Family: fam, EventID: msg.UUID}
		if consumer == "" {
			obs.Outcome = filterRejected
			f.record(obs)
			return nil, ErrNoConsumer
		}
		q, ok := inbox.QuerierFromContext(ctx)
		if !ok {
			obs.Outcome = filterRejected
			f.record(obs)
			return nil, ErrNoTransaction
		}

		var v verdict
		if f.oneTrip {
			v, err = f.cfg.Families.check(ctx, q, consumer, fam, pos)
		} else {
			v, err = f.twoSteps(msg, q, consumer, fam, pos, &obs)
		}
		if err != nil {
			obs.Outcome = filterFailed
			f.record(obs)
			return nil, err
		}
		fields := watermill.LogFields{
			"event_id":    msg.UUID,
			"consumer":    consumer,
			"family_kind": fam.Kind,
			"family_id":   fam.ID,
			"position":    pos.String(),
		}
		switch v {
		case verdictObsolete, verdictStale:
			obs.Outcome = filterObsolete
			if v == verdictStale {
				obs.Outcome = filterStale
			}
			f.record(obs)
			if !f.cfg.DisableMarkStale {
				if v == verdictObsolete {
					inbox.MarkObsolete(ctx)
				} else {
					inbox.MarkStale(ctx)
				}
			}
			f.logger.Debug("Superseded message skipped", fields.Add(watermill.LogFields{"outcome": string(obs.Outcome)}))
			return nil, nil
		}
		obs.Outcome = filterHandled
		f.record(obs)
		f.logger.Trace("Latest message of its family handled", fields)
		noteHandled(ctx, consumer, fam, pos) // for the poison step, latest_retire.go
		if !f.cfg.DisableRetireOnPoison {
			if inbox.LastAttemptBeforeCrashLoop(ctx) && f.cfg.Families.dialect != sqldb.SQLite {
				// Should the process die in this attempt, the message is
				// dead-lettered as a crash loop without reaching the
				// filter again: retired now, or held. Not on SQLite: the
				// attempt's transaction holds its only write lock, so a
				// write beside it waits out busy_timeout and fails on
				// every redelivery.
				if err := f.retireNow(ctx, msg.UUID, consumer, fam, pos); err != nil {
					return nil, inbox.Transient(err)
				}
			}
			f.retireOnPoison(ctx, msg.UUID, consumer, fam, pos)
		}
		return h(msg)
	}
}

// twoSteps reads the latest record from a separate store, then records the
// applied position in the handler's transaction.
func (f *LatestFilter) twoSteps(msg *message.Message, q sqldb.Querier, consumer string, fam Family, pos Position, obs *filterObservation) (verdict, error) {
	ctx := msg.Context()
	lq := q
	inTx := f.cfg.Latest.Transactional() && !hasDB(f.cfg.LatestDB)
	if h, err := sqldb.HandleOf(f.cfg.LatestDB); err == nil {
		lq = h.Querier()
	}
	latest, known, err := f.cfg.Latest.Latest(ctx, lq, fam)
	switch {
	case err != nil && inTx:
		return 0, err
	case err != nil:
		obs.LatestUnknown = true
		f.logger.Error("Latest-per-family record unreadable; judging the message by the applied check alone", err,
			watermill.LogFields{"event_id": msg.UUID, "family_kind": fam.Kind, "family_id": fam.ID})
	case known && latest.After(pos):
		// Obsolete unless the latest message was retired here (poisoned:
		// it will never be applied, latest_retire.go).
		retired, err := f.cfg.Families.isRetired(ctx, q, consumer, fam, latest)
		if err != nil {
			return 0, err
		}
		if !retired {
			return verdictObsolete, nil
		}
	}
	recorded, err := f.cfg.Families.recordApplied(ctx, q, consumer, fam, pos)
	if err != nil {
		return 0, err
	}
	if !recorded {
		return verdictStale, nil
	}
	return verdictHandle, nil
}

func (f *LatestFilter) record(o filterObservation) {
	if f.rec != nil {
		f.rec.RecordFilter(o)
	}
}

// hasDB reports whether db is set (not the zero DB).
func hasDB(db idempotency.DB) bool {
	_, err := sqldb.HandleOf(db)
	return err == nil
}

// retireNow retires the message at pos before its handler runs, on the
// last attempt the consumer's crash bound lets run
// (inbox.LastAttemptBeforeCrashLoop), on RetireDB or else the attempt's
// database outside its transaction. Retiring a message that then succeeds
// costs nothing but filtering: once it is applied, older messages are stale
// behind it.
func (f *LatestFilter) retireNow(ctx context.Context, eventID, consumer string, fam Family, pos Position) error {
	db := f.retireDB(ctx)
	if db == nil {
		f.logger.Error("Family message at its last attempt before a crash loop not retired: no database to retire it in "+
			"(set LatestFilterConfig.RetireDB); should it be dead-lettered as a crash loop, its family stays frozen at this consumer "+
			"until a newer message is published", nil,
			watermill.LogFields{"event_id": eventID, "consumer": consumer, "family_kind": fam.Kind, "family_id": fam.ID})
		return nil
	}
	return f.retire(ctx, db, eventID, consumer, fam, pos)
}

// retireDB is where a message is retired: RetireDB, else the attempt's
// database outside its transaction; nil when neither is known.
func (f *LatestFilter) retireDB(ctx context.Context) sqldb.Querier {
	if h, err := sqldb.HandleOf(f.cfg.RetireDB); err == nil {
		return h.Querier()
	}
	db, _ := inbox.DBFromContext(ctx)
	return db
}

// retireOnPoison registers with the chain (middleware.OnPoison) the
// retirement of the message at pos, should the chain poison it.
func (f *LatestFilter) retireOnPoison(ctx context.Context, eventID, consumer string, fam Family, pos Position) {
	db := f.retireDB(ctx)
	inbox.OnPoison(ctx, f, func(ctx context.Context) error {
		if db == nil {
			f.logger.Error("Poisoned family message not retired: no database to retire it in (set LatestFilterConfig.RetireDB); "+
				"its family stays frozen at this consumer until a newer message is published", nil,
				watermill.LogFields{"event_id": eventID, "consumer": consumer, "family_kind": fam.Kind, "family_id": fam.ID})
			return nil
		}
		return f.retire(ctx, db, eventID, consumer, fam, pos)
	})
}
