package versioned

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-idempotency/idempotency/internal/purgeloop"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// FamilyPurger defaults (FamilyPurgerConfig).
const (
	// DefaultFamilyMinHorizon is the default FamilyPurgerConfig.MinHorizon.
	DefaultFamilyMinHorizon = time.Hour
	// DefaultFamilyPurgeInterval is the default wait between purge runs.
	DefaultFamilyPurgeInterval = time.Minute
	// DefaultFamilyPurgeBatchSize is the default number of rows per DELETE.
	DefaultFamilyPurgeBatchSize = 1000
)

// FamilyPurgerConfig configures a FamilyPurger.
//
// Choosing the horizon: a family is idle when its latest record was not
// advanced, or its applied record not written, for longer than Horizon; its
// rows are then deleted. Losing a latest row only lets the family's older
// messages through (more work). Losing an applied row is what could let an
// old message be applied after a newer one, so every message of an idle
// family must be gone from the queues by then, or refused: set Horizon ≥
// the longest time a message may wait in a queue or dead-letter queue, and
// ≥ the idempotent middleware's ReplayHorizon + MaxFutureSkew + the longest
// time by which a message's event id can postdate the family's newer
// messages (the claim dates a message by its id, or occurred_at, and
// refuses it as expired only a ReplayHorizon after that; the filter orders
// by position). A producer that mints an older position's event id later
// (re-emitting an old version) needs that lag in the horizon.
type FamilyPurgerConfig struct {
	// Horizon: rows whose updated_at is older than the database's now()
	// (on SQLite the process clock, in microseconds) minus Horizon are
	// deleted. Required; must be ≥ MinHorizon.
	Horizon time.Duration
	// MinHorizon guards against a mistyped horizon. Defaults to
	// DefaultFamilyMinHorizon (1 h).
	MinHorizon time.Duration
	// Interval between runs of Start's loop. Defaults to
	// DefaultFamilyPurgeInterval (1 min).
	Interval time.Duration
	// Jitter: each wait is Interval plus a random duration in [0, Jitter),
	// so instances started together do not wake together. Defaults to
	// Interval/10.
	Jitter time.Duration
	// BatchSize bounds each DELETE (one short transaction each). Defaults to
	// DefaultFamilyPurgeBatchSize.
	BatchSize int
	// OnPurge, if set, is called after every run that held the lock, with
	// the rows deleted (metrics), while the lock is still held.
	OnPurge func(deleted int64, at time.Time)
}

func (c FamilyPurgerConfig) settings() purgeloop.Settings {
	return purgeloop.Settings{Horizon: c.Horizon, MinHorizon: c.MinHorizon, Interval: c.Interval, Jitter: c.Jitter, BatchSize: c.BatchSize}
}

func (c *FamilyPurgerConfig) setDefaults() {
	d := c.settings().WithDefaults(DefaultFamilyMinHorizon, DefaultFamilyPurgeInterval, DefaultFamilyPurgeBatchSize)
	c.MinHorizon, c.Interval, c.Jitter, c.BatchSize = d.MinHorizon, d.Interval, d.Jitter, d.BatchSize
}

// ErrFamilyHorizonTooShort is returned by NewFamilyPurger for a horizon
// below MinHorizon.
var ErrFamilyHorizonTooShort = errors.New("versioned: family purge horizon below the configured minimum")

// Validate reports the first invalid field (c with defaults applied),
// naming it.
func (c FamilyPurgerConfig) Validate() error {
	return c.settings().Validate("versioned: FamilyPurgerConfig", ErrFamilyHorizonTooShort)
}

// FamilyPurger deletes idle families' rows from a FamilyStore's tables
// (latest, applied and retired), in bounded batches, on one dedicated
// connection that holds a lock for the run: however many instances run one
// on the same tables, one works at a time and the others skip that run. On PostgreSQL the lock is a
// transaction-scoped advisory lock taken again by each batch's own
// transaction (pg_try_advisory_xact_lock: no session state outlives a
// transaction, so a pooler sharing server connections neither leaks it nor
// skips runs; two runs may take turns between batches); it is a named lock
// (GET_LOCK) held for the run on MySQL, and a lock of the
// process on SQLite (one process per database file). (A redislatest.Store needs
// none: its keys expire.)
type FamilyPurger struct {
	store  *FamilyStore
	pool   sqldb.Pool
	cfg    FamilyPurgerConfig
	logger watermill.LoggerAdapter
	// lockName names the run's named lock (MySQL) or in-process lock
	// (SQLite); PostgreSQL's advisory lock is keyed by the latest table.
	lockName string

	loop *purgeloop.Loop
}

// NewFamilyPurger validates cfg (on a copy with defaults applied) and
// purges store's tables on db. A nil logger is NopLogger.
func NewFamilyPurger(store *FamilyStore, db idempotency.DB, cfg FamilyPurgerConfig, logger watermill.LoggerAdapter) (*FamilyPurger, error) {
	h, err := sqldb.HandleOf(db)
	if store == nil || err != nil {
		return nil, errors.New("versioned: NewFamilyPurger needs a store and a DB")
	}
	pool := h.Pool()
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	name := "versioned-family:" + store.latest.String() + "," + store.applied.String()
	p := &FamilyPurger{store: store, pool: pool, cfg: cfg, logger: logger, lockName: name}
	p.loop = purgeloop.New(p.PurgeNow, cfg.Interval, cfg.Jitter, logger, "idle families",
		watermill.LogFields{"tables": store.latest.String() + "," + store.applied.String()})
	return p, nil
}

// PurgeNow runs one purge: it takes the advisory lock (or returns ran=false
// at once when another purger holds it), deletes batch after batch until a
// batch comes back short, releases the lock and returns the rows deleted.
func (p *FamilyPurger) PurgeNow(ctx context.Context) (deleted int64, ran bool, err error) {
	name := p.lockName
	if p.store.dialect == sqldb.PostgreSQL {
		name = p.store.latest.Quoted('"') // the lock is keyed by its OID
	}
	lock := func(ctx context.Context, conn sqldb.Conn) (func(), bool, error) {
		return p.store.sql.lock(ctx, conn, name)
	}
	batch := func(ctx context.Context, q sqldb.Querier, limit int) (int64, error) {
		return p.store.purgeBatch(ctx, q, p.cfg.Horizon, limit)
	}
	if p.store.dialect == sqldb.PostgreSQL {
		// A transaction-scoped lock per batch (see processed.Purger): no
		// session state outlives a transaction, behind a pooler too.
		txLock := func(ctx context.Context, q sqldb.Querier) (bool, error) {
			var ok bool
			err := q.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(`+pgFamilyLockKey+`)`, name).Scan(&ok)
			return ok, err
		}
		deleted, ran, err = purgeloop.DrainTx(ctx, p.pool, txLock, nil, batch, p.cfg.BatchSize, p.cfg.OnPurge)
	} else {
		deleted, ran, err = purgeloop.Drain(ctx, p.pool, lock, batch, p.cfg.BatchSize, p.cfg.OnPurge)
	}
	if err != nil {
		return deleted, ran, fmt.Errorf("versioned: family purge: %w", err)
	}
	return deleted, ran, nil
}

// Start runs PurgeNow every Interval (+ jitter) in a goroutine until Stop or
// ctx ends. Errors are logged and the loop goes on. Start twice is an error.
func (p *FamilyPurger) Start(ctx context.Context) error {
	if err := p.loop.Start(ctx); err != nil {
		return fmt.Errorf("versioned: family %w", err)
	}
	return nil
}

// Stop ends Start's goroutine and waits for it (an ongoing batch is
// cancelled through its context). Stop without Start is a no-op; after Stop
// the purger can be started again.
func (p *FamilyPurger) Stop() { p.loop.Stop() }
