package processedstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-idempotency/idempotency/internal/purgeloop"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Purger defaults (PurgerConfig).
const (
	DefaultMinHorizon     = time.Hour
	DefaultPurgeInterval  = time.Minute
	DefaultPurgeBatchSize = 1000
)

// PurgerConfig configures a Purger.
//
// The rule that makes a purge safe: the purge deletes a row only when the
// claim would refuse its redelivery. Both judge the row's event_at (the
// event's own time) by the database clock, the purge with Horizon and the
// claim with the store's Config.Horizon, so the inequality that must hold is
//
//	PurgerConfig.Horizon ≥ processed.Config.Horizon (of every consumer's store)
//
// NewPurger checks it against its own store (Horizon defaults to the
// store's); keep one Config for the consumers and the purger. Choose the
// store's horizon ≥ the longest outbox replay window you will run (how far
// back an operator may republish) + the longest time a message may wait in a
// queue or dead-letter queue before it is re-driven + a margin for
// incidents; clock skew needs no margin (one clock judges both).
type PurgerConfig struct {
	// Horizon: rows whose event_at is older than the database's now()
	// minus Horizon are deleted. Defaults to the store's Config.Horizon;
	// must be ≥ it (ErrHorizonBelowClaim) and ≥ MinHorizon.
	Horizon time.Duration
	// FromTable makes each run purge by the horizon the table keeps
	// (PurgeHorizon) instead of Horizon; a table that keeps none is not
	// purged.
	FromTable bool
	// MinHorizon guards against a mistyped horizon that would purge records
	// still needed for deduplication. Defaults to DefaultMinHorizon (1 h).
	MinHorizon time.Duration
	// Interval between runs of Start's loop. Defaults to DefaultPurgeInterval.
	Interval time.Duration
	// Jitter: each wait is Interval plus a random duration in [0, Jitter), so
	// that instances started together do not all wake at once. Defaults to
	// Interval/10.
	Jitter time.Duration
	// BatchSize bounds each DELETE (one short transaction each), so the purge
	// never holds locks on many rows at once. Defaults to DefaultPurgeBatchSize.
	BatchSize int
	// OnPurge, if set, is called after every run that held the lock, with the
	// rows deleted (metrics).
	OnPurge func(deleted int64, at time.Time)
}

func (c PurgerConfig) settings() purgeloop.Settings {
	return purgeloop.Settings{Horizon: c.Horizon, MinHorizon: c.MinHorizon, Interval: c.Interval, Jitter: c.Jitter, BatchSize: c.BatchSize}
}

func (c *PurgerConfig) setDefaults() {
	d := c.settings().WithDefaults(DefaultMinHorizon, DefaultPurgeInterval, DefaultPurgeBatchSize)
	c.MinHorizon, c.Interval, c.Jitter, c.BatchSize = d.MinHorizon, d.Interval, d.Jitter, d.BatchSize
}

// ErrHorizonTooShort is returned by NewPurger for a horizon below MinHorizon.
var ErrHorizonTooShort = errors.New("processed: replay horizon below the configured minimum")

// ErrHorizonBelowClaim is returned by NewPurger when its horizon is below
// its store's Config.Horizon, or the store has none (its claim refuses no
// event, so any purged event would be claimed, and applied, again).
var ErrHorizonBelowClaim = errors.New("processed: purge horizon below the claim's horizon (processed.Config.Horizon)")

// Validate reports the first invalid field, naming it (c with defaults applied).
func (c PurgerConfig) Validate() error {
	return c.settings().Validate("processed: PurgerConfig", ErrHorizonTooShort)
}

// Purger deletes processed rows dated (event_at) before the replay horizon, in bounded
// batches, on one dedicated connection, under a lock: however many
// instances run a Purger on the same table, one works at a time and the
// others skip that run. On PostgreSQL the lock is transaction-scoped
// (pg_try_advisory_xact_lock), taken again by each batch's own
// transaction, so no session state outlives a transaction and a pooler
// sharing server connections (PgBouncer in transaction pooling) neither
// leaks it nor skips runs; two runs may then take turns between batches.
// On MySQL it is a session lock (GET_LOCK) held for the run, on SQLite a
// lock of the process.
type Purger struct {
	store  *Store
	pool   sqldb.Pool
	cfg    PurgerConfig
	logger watermill.LoggerAdapter

	loop *purgeloop.Loop
}

// NewPurger validates cfg (on a copy with defaults applied). pool is
// sqldb.PgxPool(pool) or sqldb.StdPool(db). A nil logger is NopLogger.
func NewPurger(store *Store, pool sqldb.Pool, cfg PurgerConfig, logger watermill.LoggerAdapter) (*Purger, error) {
	if store == nil || pool == nil {
		return nil, errors.New("processed: NewPurger needs a store and a pool")
	}
	if cfg.Horizon == 0 {
		cfg.Horizon = store.Horizon()
	}
	if cfg.FromTable && cfg.Horizon == 0 {
		cfg.Horizon = max(cfg.MinHorizon, DefaultMinHorizon) // validated per run against the table's
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if !cfg.FromTable && (store.Horizon() <= 0 || cfg.Horizon < store.Horizon()) {
		return nil, fmt.Errorf("%w: PurgerConfig.Horizon %s, store %s horizon %s: the purge would delete rows whose redelivery the claim still accepts",
			ErrHorizonBelowClaim, cfg.Horizon, store.table, store.Horizon())
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	p := &Purger{store: store, pool: pool, cfg: cfg, logger: logger}
	p.loop = purgeloop.New(p.PurgeNow, cfg.Interval, cfg.Jitter, logger, "processed events",
		watermill.LogFields{"table": store.table.String()})
	return p, nil
}

// PurgeNow runs one purge: it takes the advisory lock (or returns ran=false
// at once when another purger holds it), with LayoutPartitioned creates and
// drops partitions (Store.MaintainPartitions), deletes batch after batch
// until a batch comes back short, releases the lock and returns the rows
// deleted (rows of dropped partitions are not counted).
func (p *Purger) PurgeNow(ctx context.Context) (deleted int64, ran bool, err error) {
	horizon := p.cfg.Horizon
	onPurge := p.cfg.OnPurge
	createOnly := false // partitions ahead, nothing purged
	if p.cfg.FromTable {
		conn, err := p.pool.Acquire(ctx)
		if err != nil {
			return 0, false, fmt.Errorf("processed: purge: %w", err)
		}
		h, ok, err := p.store.PurgeHorizon(ctx, conn, time.Now())
		conn.Release()
		if err != nil {
			return 0, false, err
		}
		if !ok {
			p.logger.Info("Processed events not purged: the table keeps no replay horizon, or recorded one within "+
				"HorizonChangeGrace of keeping none", watermill.LogFields{"table": p.store.table.String()})
			if p.store.layout != LayoutPartitioned {
				return 0, false, nil
			}
			// The spans ahead are still created: claims would land in
			// the default partition once Migrate's are behind.
			createOnly, onPurge, h = true, nil, 0
		} else if h < p.cfg.MinHorizon {
			return 0, false, fmt.Errorf("%w: the table %s keeps %s, PurgerConfig.MinHorizon is %s", ErrHorizonTooShort, p.store.table, h, p.cfg.MinHorizon)
		}
		horizon = h
	}
	maintained := p.store.layout != LayoutPartitioned
	legacy := false // an upgrade from the plain layout in progress
	// v7: the table has <table>_v7 (v7Checked: read in this run).
	v7, v7Checked := false, false
	// recheck reads the table's horizon again once the mark is written:
	// the run's horizon was read before, and a widening (or none) since
	// then lets a consumer restarted with it read the mark before this
	// run wrote it, and take the wider window. Read after the mark, the
	// widening is seen (the run then deletes by it, or nothing); made
	// after this read, it waits for the mark (on PostgreSQL the read
	// holds row 1 FOR SHARE until the batch commits its mark and
	// deletes; elsewhere the mark is committed before it).
	recheck := func(ctx context.Context, q sqldb.Querier) error {
		if !p.cfg.FromTable {
			return nil
		}
		h, ok, err := p.store.purgeHorizonForUpdate(ctx, q, time.Now())
		if err != nil {
			return err
		}
		if !ok { // none now: nothing more is purged in this run
			createOnly, onPurge, horizon = true, nil, 0
			return nil
		}
		horizon = max(horizon, h)
		return nil
	}
	// dropHorizon is the age past which maintenance drops a partition:
	// none (0: create only) while the run purges nothing, whose
	// consumers may refuse nothing.
	dropHorizon := func() time.Duration {
		if createOnly {
			return 0
		}
		return horizon + purgeClaimSlack
	}
	batch := func(ctx context.Context, q sqldb.Querier, limit int) (int64, error) {
		// How far the table may be purged, raised before anything is
		// deleted or dropped (on PostgreSQL in the batch's transaction): a
		// consumer started after the horizon is widened refuses what this
		// run deletes (Store.purgedWindow).
		if !createOnly {
			if err := p.store.notePurge(ctx, q, horizon); err != nil {
				return 0, err
			}
			if err := recheck(ctx, q); err != nil {
				return 0, err
			}
		}
		if !maintained { // once per run, under the lock
			maintained = true
			var err error
			if legacy, err = p.store.legacyExists(ctx, q); err != nil {
				return 0, err
			}
			maintain := p.store.maintainLocked
			if p.cfg.FromTable { // the table's horizon is the claim's, by construction
				maintain = p.store.maintain
			}
			rep, err := maintain(ctx, q, dropHorizon(), "")
			if err != nil {
				return 0, err
			}
			p.logMaintenance(rep)
		}
		if createOnly {
			return 0, nil
		}
		if p.store.dialect == sqldb.PostgreSQL {
			// The batch's own transaction (DrainTx): no JIT for its DELETE.
			// The planner prices the per-consumer arm for a hundred
			// consumers, above jit_above_cost on tables of a few ten
			// thousand rows already, and every batch then compiled it
			// (0.2 to 1.5 s for a batch of 1,000 rows: a backlog of
			// millions purged at a few thousand rows a second).
			if _, err := q.Exec(ctx, "SET LOCAL jit = off"); err != nil {
				return 0, err
			}
		}
		n, err := p.store.PurgeBatch(ctx, q, horizon+purgeClaimSlack, limit)
		if err != nil {
			return n, err
		}
		if p.store.v7sql != nil {
			// The UUIDv7 claim table (migration 0008), read once per run:
			// its expired rows go by DELETE too, a range per consumer.
			if !v7Checked {
				var denied bool
				if v7, denied, err = p.store.v7Purgeable(ctx, q); err != nil {
					return n, err
				}
				if denied {
					p.logger.Error("Purge: the UUIDv7 claim table is not purged: grant this role SELECT, UPDATE and DELETE on it and SELECT on <table>_consumer", nil,
						watermill.LogFields{"table": p.store.sibling("v7")})
				}
				v7Checked = true
			}
			if v7 {
				m, err := p.store.purgeV7Batch(ctx, q, horizon+purgeClaimSlack, limit)
				n += m // ≥ limit (one more batch) while either is full
				if err != nil {
					return n, err
				}
			}
		}
		if !legacy {
			return n, nil
		}
		// The legacy table of an upgrade (MigrateToPartitioned): its
		// expired rows go by DELETE too; the run ends when both come back
		// short.
		m, err := p.store.purgeLegacyBatch(ctx, q, horizon+purgeClaimSlack, limit)
		return n + m, err // ≥ limit (one more batch) while either is full
	}
	if p.store.dialect == sqldb.PostgreSQL {
		// A transaction-scoped lock per batch: no session state outlives a
		// transaction, so a pooler sharing server connections between
		// clients (PgBouncer in transaction pooling) neither leaks the lock
		// to another client nor runs the unlock elsewhere.
		var key int64 // the lock's key, read with the first lock
		lock := func(ctx context.Context, q sqldb.Querier) (bool, error) {
			var ok bool
			err := q.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(k), k FROM (SELECT `+pgPurgeLockKey+` AS k) l`,
				p.store.table.Quoted('"')).Scan(&ok, &key)
			return ok, err
		}
		var first func(context.Context, sqldb.Querier) error
		if !maintained {
			maintained = true
			first = func(ctx context.Context, q sqldb.Querier) error {
				if !createOnly { // before the drops, as before each batch
					if err := p.store.notePurge(ctx, q, horizon); err != nil {
						return err
					}
					if err := recheck(ctx, q); err != nil {
						return err
					}
				}
				var err error
				if legacy, err = p.store.legacyExists(ctx, q); err != nil {
					return err
				}
				// Each CREATE and DROP waits (within its lock timeout) for
				// the purge lock in its own implicit transaction.
				maintain := p.store.maintainLocked
				if p.cfg.FromTable { // the table's horizon is the claim's, by construction
					maintain = p.store.maintain
				}
				rep, err := maintain(ctx, q, dropHorizon(), fmt.Sprintf("SELECT pg_advisory_xact_lock(%d); ", key))
				if err != nil {
					return err
				}
				p.logMaintenance(rep)
				return nil
			}
		}
		deleted, ran, err = purgeloop.DrainTx(ctx, p.pool, lock, first, batch, p.cfg.BatchSize, onPurge)
	} else {
		deleted, ran, err = purgeloop.Drain(ctx, p.pool, p.lock, batch, p.cfg.BatchSize, onPurge)
	}
	if createOnly {
		ran = false // nothing purged: the table keeps no horizon in force
	}
	if err != nil {
		return deleted, ran, fmt.Errorf("processed: purge: %w", err)
	}
	return deleted, ran, nil
}

// logMaintenance logs what a partition maintenance did or deferred.
func (p *Purger) logMaintenance(rep PartitionReport) {
	f := watermill.LogFields{"table": p.store.table.String(), "created": rep.Created, "dropped": rep.Dropped}
	for _, e := range rep.Skipped {
		p.logger.Error("Partition maintenance deferred to the next run", e, f)
	}
	if len(rep.Created)+len(rep.Dropped) > 0 {
		p.logger.Info("Partitions maintained", f)
	}
}

// pgPurgeLockKey is the PostgreSQL purge lock's key: the table's OID ($1,
// its quoted name resolved through the search_path, so tables of one name
// in different schemas have different locks) under the constant high word
// 0x1de0, apart from other advisory-lock users.
const pgPurgeLockKey = `(x'1de0'::bigint << 32) | $1::regclass::oid::bigint`

// lock takes the purge lock for one run (MySQL, SQLite): a session-level lock held
// by conn (PostgreSQL pg_try_advisory_lock, MySQL GET_LOCK), or a lock of the
// process per database file where the dialect has none (SQLite).
func (p *Purger) lock(ctx context.Context, conn sqldb.Conn) (unlock func(), ok bool, err error) {
	d := p.store.sql
	if d.tryLock == "" {
		return purgeloop.SQLiteProcessLock("processed:"+p.store.table.String())(ctx, conn)
	}
	arg := p.store.table.Quoted(p.store.dialect.QuoteChar())
	var got any
	if err := conn.QueryRow(ctx, d.tryLock, arg).Scan(&got); err != nil {
		return nil, false, err
	}
	if !truthy(got) {
		return nil, false, nil
	}
	return func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		var ignored any
		_ = conn.QueryRow(uctx, d.unlock, arg).Scan(&ignored)
	}, true, nil
}

// truthy reads a lock function's answer: bool (PostgreSQL) or 1 (MySQL).
func truthy(v any) bool {
	switch x := v.(type) {
	case bool:
		return x
	case int64:
		return x == 1
	case int32:
		return x == 1
	case []byte:
		return string(x) == "1"
	}
	return false
}

// Start runs PurgeNow every Interval (+ jitter) in a goroutine until Stop or
// ctx ends. Errors are logged and the loop goes on. Start twice is an error.
func (p *Purger) Start(ctx context.Context) error {
	if err := p.loop.Start(ctx); err != nil {
		return fmt.Errorf("processed: %w", err)
	}
	return nil
}

// Stop ends Start's goroutine and waits for it (an ongoing batch is
// cancelled through its context). Stop without Start is a no-op.
func (p *Purger) Stop() { p.loop.Stop() }
