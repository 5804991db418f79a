package processed

import (
	"context"
	"fmt"
	"io/fs"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Defaults.
const (
	// DefaultTable is the processed-event table's default name.
	DefaultTable = processedstore.DefaultTable
	// DefaultPartitionSpan is a partition's time span with LayoutPartitioned.
	DefaultPartitionSpan = processedstore.DefaultPartitionSpan
	// DefaultMinHorizon is PurgerConfig.MinHorizon's default.
	DefaultMinHorizon = processedstore.DefaultMinHorizon
	// DefaultPurgeInterval is PurgerConfig.Interval's default.
	DefaultPurgeInterval = processedstore.DefaultPurgeInterval
	// DefaultPurgeBatchSize is PurgerConfig.BatchSize's default.
	DefaultPurgeBatchSize = processedstore.DefaultPurgeBatchSize
	// HorizonChangeGrace is how long after SetReplayHorizon shortened a
	// table's horizon the purge keeps the longer, previous one, and how
	// long after a horizon was recorded on a table that kept none (by a
	// consumer or SetReplayHorizon) it purges nothing: restart the table's
	// consumers with the new value within it.
	HorizonChangeGrace = processedstore.HorizonChangeGrace
)

// Layout is the physical layout of the table.
type Layout = processedstore.Layout

// The layouts.
const (
	// LayoutPlain is one table, purged by DELETE in batches (the default).
	LayoutPlain = processedstore.LayoutPlain
	// LayoutPartitioned is a table RANGE-partitioned by UUIDv7 time
	// (PostgreSQL 14+), purged by dropping whole partitions.
	LayoutPartitioned = processedstore.LayoutPartitioned
)

var (
	// ErrHorizonMismatch: a consumer is configured with another replay
	// horizon than its table keeps.
	ErrHorizonMismatch = processedstore.ErrHorizonMismatch
	// ErrHorizonTooShort: the table's horizon is below PurgerConfig.MinHorizon.
	ErrHorizonTooShort = processedstore.ErrHorizonTooShort
	// ErrPlainTable: Migrate with LayoutPartitioned found a plain table
	// (convert it with MigrateToPartitioned).
	ErrPlainTable = processedstore.ErrPlainTable
)

// Config names a processed-event table and its layout.
type Config struct {
	// Table is "name" or "schema.name" (letters, digits, underscores, at
	// most 63 bytes a part). Defaults to DefaultTable.
	Table string
	// Layout defaults to LayoutPlain.
	Layout Layout
	// PartitionSpan is a partition's span with LayoutPartitioned: whole
	// minutes. Defaults to DefaultPartitionSpan (1 h).
	PartitionSpan time.Duration
}

func (c Config) store(db idempotency.DB) (*processedstore.Store, *sqldb.Handle, error) {
	h, err := sqldb.HandleOf(db)
	if err != nil {
		return nil, nil, fmt.Errorf("processed: %w", err)
	}
	s, err := processedstore.NewStore(processedstore.Config{Table: c.Table, Dialect: h.Dialect, Layout: c.Layout, PartitionSpan: c.PartitionSpan})
	if err != nil {
		return nil, nil, err
	}
	return s, h, nil
}

// Migrate creates or upgrades the table (and its horizon row table) and
// records each applied migration in the idempotency_migration table. It is
// idempotent and safe to run from several instances at once (an advisory
// lock on PostgreSQL and MySQL). On PostgreSQL's plain layout it then
// copies the table's UUIDv7 rows into <table>_v7 (migration 8) in batches
// of 10,000, once, and marks it ready for the consumers started after.
func Migrate(ctx context.Context, db idempotency.DB, cfg Config) error {
	s, h, err := cfg.store(db)
	if err != nil {
		return err
	}
	return s.Migrate(ctx, h.Querier())
}

// MigrationsFS returns the table's migrations as an fs.FS of
// "NNNN_name.up.sql" files, for golang-migrate or goose (each file carries a
// "-- +goose Up" line) when a migration tool owns the schema. On PostgreSQL
// run Migrate once after them: it copies the table's UUIDv7 rows into
// <table>_v7 (migration 8), and until it has, claims stay in the table.
func MigrationsFS(table string, dialect idempotency.Dialect) (fs.FS, error) {
	return processedstore.MigrationsFS(table, dialect)
}

// MigrateToPartitioned converts a plain table to LayoutPartitioned
// (PostgreSQL 14+) while consumers run: the old table becomes
// <table>_legacy, still consulted by the claim and purged by the Purger.
// Running it again after it succeeded does nothing.
func MigrateToPartitioned(ctx context.Context, db idempotency.DB, cfg Config) error {
	cfg.Layout = LayoutPartitioned
	s, h, err := cfg.store(db)
	if err != nil {
		return err
	}
	return s.MigrateToPartitioned(ctx, h.Querier())
}

// ReplayHorizon returns the horizon the table keeps (0 when none).
func ReplayHorizon(ctx context.Context, db idempotency.DB, table string) (time.Duration, error) {
	s, h, err := Config{Table: table}.store(db)
	if err != nil {
		return 0, err
	}
	cur, _, _, _, err := s.TableHorizon(ctx, h.Querier())
	return cur, err
}

// SetReplayHorizon changes the horizon the table keeps (0: none, nothing
// refused or purged). Consumers verify it when they start (a consumer
// configured with another value is refused with ErrHorizonMismatch), so
// restart them with the new value. A longer horizon purges less at once,
// and 0 purges nothing at once; a shorter one is used by the purge only
// after HorizonChangeGrace, and so is one set on a table that kept none
// (0) that a consumer started on, so a consumer still running with the old
// value (or with none) never accepts an event whose record was purged. A
// change within HorizonChangeGrace of an earlier one keeps the longest
// horizon in force since the earlier one (none included) for its own
// grace; setting the horizon the table keeps changes nothing. After a
// longer horizon (or 0), a consumer restarted while rows the shorter one
// purged are younger than the new horizon claims with the time since that
// purge as its window, so it refuses their redeliveries as expired
// (docs/retention.md).
func SetReplayHorizon(ctx context.Context, db idempotency.DB, table string, d time.Duration) error {
	s, h, err := Config{Table: table}.store(db)
	if err != nil {
		return err
	}
	return s.SetHorizon(ctx, h.Querier(), d, time.Now())
}

// PurgerConfig configures a Purger.
type PurgerConfig struct {
	// DB is the table's database. Required.
	DB idempotency.DB
	// Table, Layout and PartitionSpan name the table, as in Config.
	Table         string
	Layout        Layout
	PartitionSpan time.Duration
	// MinHorizon refuses to purge by a table horizon below it (a mistyped
	// horizon). Defaults to DefaultMinHorizon (1 h).
	MinHorizon time.Duration
	// Interval is the time between runs (Start), plus up to Jitter.
	// Default to DefaultPurgeInterval (1 min) and 0.
	Interval time.Duration
	Jitter   time.Duration
	// BatchSize is the rows deleted per statement. Defaults to
	// DefaultPurgeBatchSize (1000).
	BatchSize int
	// OnPurge, when set, is called after each run with the rows deleted.
	OnPurge func(deleted int64, at time.Time)
}

// Purger deletes the rows older than the table's replay horizon (by the
// database clock), in bounded batches; with LayoutPartitioned it creates
// partitions ahead and drops expired ones. However many instances run one
// on a table, one works at a time and the others skip that run. A table
// that keeps no horizon (0) is never purged.
type Purger struct{ p *processedstore.Purger }

// NewPurger validates cfg (on a copy with defaults). A nil logger is
// watermill.NopLogger.
func NewPurger(cfg PurgerConfig, logger watermill.LoggerAdapter) (*Purger, error) {
	s, h, err := Config{Table: cfg.Table, Layout: cfg.Layout, PartitionSpan: cfg.PartitionSpan}.store(cfg.DB)
	if err != nil {
		return nil, fmt.Errorf("processed: PurgerConfig: %w", err)
	}
	p, err := processedstore.NewPurger(s, h.Pool(), processedstore.PurgerConfig{
		FromTable: true, MinHorizon: cfg.MinHorizon, Interval: cfg.Interval, Jitter: cfg.Jitter,
		BatchSize: cfg.BatchSize, OnPurge: cfg.OnPurge,
	}, logger)
	if err != nil {
		return nil, err
	}
	return &Purger{p}, nil
}

// PurgeNow runs one purge and returns the rows deleted; ran is false when
// another purger held the table's lock or the table keeps no horizon.
func (p *Purger) PurgeNow(ctx context.Context) (deleted int64, ran bool, err error) {
	return p.p.PurgeNow(ctx)
}

// Start runs PurgeNow every Interval in a goroutine until Stop or ctx ends;
// errors are logged and the loop goes on. Start twice is an error.
func (p *Purger) Start(ctx context.Context) error { return p.p.Start(ctx) }

// Stop ends Start's goroutine and waits for it. Stop without Start is a no-op.
func (p *Purger) Stop() { p.p.Stop() }
