package middleware

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/outboxdb"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// Defaults of ConsumerConfig.
const (
	DefaultLockTimeout          = inbox.DefaultLockTimeout
	DefaultMaxFutureSkew        = processedstore.DefaultMaxFutureSkew
	DefaultMaxRetries           = inbox.DefaultMaxRetries
	DefaultInitialInterval      = inbox.DefaultInitialInterval
	DefaultMaxInterval          = inbox.DefaultMaxInterval
	DefaultMultiplier           = inbox.DefaultMultiplier
	DefaultMaxHold              = inbox.DefaultMaxHold
	DefaultMaxHeaderBytes       = inbox.DefaultMaxHeaderBytes
	DefaultMaxCopiedHeaderBytes = inbox.DefaultMaxCopiedHeaderBytes
	DefaultMaxCrashes           = 3
)

// Metadata keys the consumer sets on a poisoned message, besides
// Watermill's reason_poisoned, topic_poisoned, handler_poisoned and
// subscriber_poisoned.
const (
	// MetadataPoisonClass is "permanent" (no retry could fix it) or
	// "exhausted" (an ordinary error that survived the retries).
	MetadataPoisonClass = inbox.MetadataPoisonClass
	// MetadataReasonBytes is the full reason's length in bytes, set only
	// when reason_poisoned was truncated to PoisonConfig.MaxHeaderBytes.
	MetadataReasonBytes = inbox.MetadataReasonBytes
	// MetadataDroppedHeaders lists the keys of the failed message's metadata
	// left off its poisoned copy (PoisonConfig.MaxCopiedHeaderBytes).
	MetadataDroppedHeaders = inbox.MetadataDroppedHeaders
	// MetadataAttempt is the attempt number of the delivery being handled
	// (1 for the first), set on the message for the handler.
	MetadataAttempt = inbox.MetadataAttempt
)

var (
	// ErrAttached is returned by AddConsumerHandler and AddHandler on a
	// Consumer that already serves a handler: a Consumer serves one handler.
	ErrAttached = errors.New("middleware: the consumer already serves a handler")
	// ErrSharedConsumer is returned when a second Consumer of the same name,
	// on the same database pool and table, attaches to a handler of another
	// name in this process. Competing workers of one consumer share a
	// handler name; two handlers that each receive their own copy of an
	// event (a fan-out) need two consumer names, or the first handler's
	// claim makes the other's copy a duplicate and its effect is skipped.
	ErrSharedConsumer = inbox.ErrSharedConsumer
)

// ConsumerConfig configures NewConsumer. Zero values take the defaults.
type ConsumerConfig struct {
	// Consumer is the claim key's first half: the name of the logical
	// consumer whose effects are applied once per event_id. Required; keep
	// it stable across deployments (renaming it makes every retained event
	// new again). Competing workers of one consumer, in any process, share
	// it; two handlers that each receive their own copy of an event use two
	// names (see ErrSharedConsumer). There is no default from the handler's
	// name: two processes naming their handlers differently would apply
	// events twice.
	Consumer string

	// DB is the consumer's database (idempotency.Pgx or idempotency.SQL):
	// each attempt's transaction, the claim and the handler's effects all
	// run on it. Required.
	DB idempotency.DB

	// Table is the processed-event table, "name" or "schema.name" (letters,
	// digits, underscores; validated and quoted once). Create it with
	// processed.Migrate. On PostgreSQL, NewConsumer names an unqualified
	// table with the schema DB's search_path finds it in, once (a
	// handler's session-level SET search_path moves no later claim); a
	// table not found yet follows each connection's search_path
	// (docs/databases.md). Defaults to processed.DefaultTable
	// ("processed_event").
	Table string

	// ReplayHorizon is how long the table keeps a processed event, and the
	// age beyond which an event is refused as expired (ErrExpired,
	// permanent): its record may already be purged. Both are judged by the
	// database clock on the event's own time (its UUIDv7 timestamp, else
	// occurred_at), so no clock skew lets a purged event apply twice. Choose
	// it ≥ the longest outbox replay window + the longest time a message may
	// wait in a queue or dead-letter queue + a margin. The horizon lives
	// with the table (processed.ReplayHorizon, processed.SetReplayHorizon),
	// and the table's processed.Purger purges by it: NewConsumer records
	// this value when the table keeps none and refuses another one than
	// the table's (processed.ErrHorizonMismatch). 0 (the default) adopts
	// the table's horizon and records none: on a table that keeps none
	// the consumer refuses nothing (no replay window, MaxFutureSkew
	// unused) and the table is never purged, until a consumer with a
	// horizon (or processed.SetReplayHorizon) records one; the purge then
	// waits processed.HorizonChangeGrace before using it, so restart the
	// consumers started at 0 within it to adopt it.
	ReplayHorizon time.Duration

	// MaxFutureSkew bounds how far ahead of the database clock an event may
	// be dated (ErrFuture, permanent: its producer's clock is wrong). Only
	// with ReplayHorizon > 0. Defaults to DefaultMaxFutureSkew (5 min). On
	// pgx over a direct connection the bound is judged by the database
	// clock the connection last read: a database clock stepped back since
	// lets an event up to that step beyond it through.
	MaxFutureSkew time.Duration

	// Layout is the table's layout (processed.LayoutPlain, the default, or
	// processed.LayoutPartitioned on PostgreSQL); it must match the layout
	// processed.Migrate created.
	Layout processedstore.Layout

	// Poison is where messages that cannot be processed go. Required.
	Poison PoisonConfig

	// Retry shapes retries and holds. Zero values take the defaults.
	Retry RetryConfig

	// AfterPoison are middlewares placed just inside the poison layer and
	// outside the retries, outermost first: routers that take some
	// permanent errors elsewhere before the poison topic sees them
	// (operation.RouteUncertain). Defaults to none; a nil entry is
	// refused.
	AfterPoison []message.HandlerMiddleware

	// Outbox, when set (recommended), writes the messages a handler
	// produces (returned, or published through PublisherFromContext) to
	// this outbox in the attempt's transaction; its relay publishes them
	// after the commit. Without it, returned messages go back to the
	// router, which publishes them after the commit: a crash in between
	// loses them. Build it on DB's handle (outbox.Config.DB): its rows are
	// written, in its SQL, with each attempt's transaction on DB, and its
	// relay reads them through its own handle. NewConsumer and Validate
	// refuse an outbox built for another kind of database than DB (another
	// dialect): DB's transactions cannot run its SQL, and every event
	// whose handler produces a message would fail and be dead-lettered.
	// Another handle of the same database and dialect (a pool of its own
	// for the relay) is accepted; the consumer cannot tell it from one of
	// another database or schema, where its relay would never read the
	// rows the consumer writes into DB's.
	Outbox *outbox.Outbox

	// OutboxTopic is the destination topic of returned messages written to
	// the outbox. Defaults to the handler's publish topic. Only with Outbox:
	// NewConsumer and Validate refuse it without one (it would be ignored).
	OutboxTopic string

	// LockTimeout bounds the wait on a claim held by another, uncommitted
	// transaction (two deliveries of one event at once) and on the claim
	// table's lock; when it expires the attempt fails, transiently: on
	// PostgreSQL with ErrInFlight, on MySQL with the driver's 1205
	// ER_LOCK_WAIT_TIMEOUT and on SQLite with SQLITE_BUSY, each an
	// ErrInfrastructure (the core links neither driver, so it cannot tell
	// their lock wait from another transient error). The consumer holds
	// the delivery and re-runs the attempt in
	// place, with the retry backoff, until the other transaction has ended
	// (committed: the delivery skips as a duplicate; rolled back: it is
	// processed) or Retry.MaxHold passed (the router then nacks it); never
	// poisoned. On PostgreSQL it is lock_timeout for the
	// whole attempt, so a handler statement that waits longer on a lock
	// also fails, transiently (SQLSTATE 55P03). With idempotency.Pgx over a
	// direct connection it is the session's lock_timeout, set once per
	// connection (and by the claim for its own transaction), which the
	// pool's connections keep for other code too;
	// behind a pooler (PgBouncer) and with SQL it is SET LOCAL, sent in the
	// claim's round trip (docs/databases.md). Whole milliseconds, at least
	// 1 ms, at most 1 minute (the purger keeps a row 5 minutes past the
	// horizon for a claim that waits on it). Defaults to
	// DefaultLockTimeout (15 s); negative leaves the session's
	// lock_timeout untouched, and then a wait longer than 5 minutes may
	// outlast that slack.
	LockTimeout time.Duration

	// DisablePayloadVerification turns off the comparison of a duplicate
	// with what was applied. With it on (the default) the claim also
	// stores the event's name and a fingerprint of name and payload
	// (XXH64: another event reusing an id is missed with probability about
	// 2⁻⁶⁴), and a duplicate with other content is refused as
	// ErrEventIDReused (permanent) instead of being acked unseen. Rows of
	// earlier releases (SHA-256 fingerprints) are compared too.
	DisablePayloadVerification bool

	// JoinSQLSubscriber makes each attempt join the transaction of a
	// watermill-sql v4 subscriber (the message's context carries it) under
	// a SAVEPOINT, instead of beginning one on DB. Use it only with a
	// watermill-sql subscriber on DB (PostgreSQL). An attempt that claimed
	// its event keeps a row in <table>_running (processed migration 0009)
	// until it ends, whose deferred foreign key fails any COMMIT made
	// before (23503): watermill-sql's subscriber commits its batch when a
	// message outlives its AckDeadline (30 s by default) or it closes, and
	// that commit takes nothing of a running attempt; the message comes
	// again. Every attempt is counted for MaxCrashes (two writes more): a
	// death rolls back the whole batch. docs/transports.md.
	JoinSQLSubscriber bool

	// MaxCrashes bounds how many attempts of one message may start and never
	// end — the process died in them (out of memory, a fatal error,
	// os.Exit, a liveness probe killing a hung handler) — before the message
	// is dead-lettered with reason "crash_loop" (ErrCrashLoop, permanent),
	// so that it stops killing every consumer that receives it and the
	// messages behind it are applied. Attempts are counted in the table's
	// <table>_crash table, in autocommit (one more when an attempt starts,
	// one less when it ends; deleted when the event is processed or
	// dead-lettered; one counted redelivery at a time in the process, so
	// that a crash counts the attempt that was running and not a healthy
	// one beside it), for redeliveries only on transports that mark
	// them (AMQP's redelivered flag, quorum queues' x-delivery-count,
	// JetStream's NumDelivered, Redis Streams' pending delivery count), and
	// for the first 64 attempts of events not processed yet after the
	// consumer is built on transports that mark none and, on Kafka, for
	// each attempt of a new event unless the process committed an attempt
	// of a new event at the record just before it in its partition (a
	// message that killed the process is the first record of its partition
	// a restarted member attempts, however many partitions it owns; a
	// record after a failed attempt, its retry included, is counted). The
	// bound is per consumer: a process running several consumers that one
	// message kills dies up to MaxCrashes times for each. A first delivery on a marking
	// transport writes nothing. The broker's delivery count bounds the
	// crashes counted but is not taken as one: it also counts messages
	// buffered behind the crashing one and never handled. So the message is
	// dead-lettered at its MaxCrashes+2nd delivery on a marking transport
	// (its first crash wrote nothing), at its MaxCrashes+1st on Kafka when
	// each crash came within a start's first 64 attempts or after a gap in
	// its partition (one more when one came later, right after the record
	// before it). On Redis Streams without
	// redisstream.CountingClient every attempt is counted, one at a time
	// (dead-lettered at its MaxCrashes+1st delivery). A delivery held
	// through an outage ends its attempts normally and is never counted: an
	// end the database was too far away to take is kept in the process and
	// written before its next attempt of any event. A process stopped
	// before the database is back cannot write it: that start stays
	// counted, as a crash would (MaxCrashes such stops in a row, each in
	// an outage that began during an attempt of the same event, dead-letter
	// it). A counted delivery of an event already processed is a
	// duplicate, never a crash loop: its row is read first (one read-only
	// statement, no transaction), nothing is counted and the handler is
	// skipped. Defaults to DefaultMaxCrashes (3); negative: never.
	MaxCrashes int

	// Recorder receives one Observation per attempt (metrics). Defaults to
	// none.
	Recorder Recorder

	// Classifier classifies, by code, database errors of a driver the
	// library does not link, when they come from an attempt: for MySQL and
	// MariaDB, mysqlerr.Classify. PostgreSQL and SQLite need none.
	Classifier ErrorClassifier
}

// PoisonConfig is where a consumer sends messages that cannot be processed:
// permanent errors at once, ordinary errors once the retries are exhausted.
// Transient and configuration errors never go there.
type PoisonConfig struct {
	// Publisher receives poisoned messages. Required. The message is acked
	// only after Publish returned nil, so Publish must return nil only once
	// the broker has the message: on RabbitMQ use the confirmed, mandatory
	// publisher of the amqp adapter module (NewConfirmedPublisher). A failed
	// publish is retried with backoff, the delivery held.
	Publisher message.Publisher
	// Topic is the poison topic. Required.
	Topic string
	// MaxHeaderBytes bounds each metadata value the consumer adds to a
	// poisoned message; a longer reason is cut and says so. Defaults to
	// DefaultMaxHeaderBytes (4 KiB); at least 64.
	MaxHeaderBytes int
	// MaxCopiedHeaderBytes bounds the failed message's metadata copied onto
	// its poisoned copy (keys and values added up); past it the largest
	// values are left out (MetadataDroppedHeaders). Defaults to
	// DefaultMaxCopiedHeaderBytes (64 KiB); negative copies nothing.
	MaxCopiedHeaderBytes int
}

// RetryConfig shapes the consumer's retries (ordinary errors, in process)
// and holds (transient and configuration errors, in place).
type RetryConfig struct {
	// MaxRetries is how many times an attempt that failed with an ordinary
	// error is re-run before the message is poisoned. Defaults to
	// DefaultMaxRetries (5).
	MaxRetries int
	// InitialInterval, MaxInterval and Multiplier shape the exponential
	// backoff between retries, between attempts of a held delivery and
	// between poison publishes. Default to DefaultInitialInterval (100 ms),
	// DefaultMaxInterval (10 s), DefaultMultiplier (2).
	InitialInterval time.Duration
	MaxInterval     time.Duration
	Multiplier      float64
	// MaxHold bounds how long one delivery is held while its attempts fail
	// with transient or configuration errors; then the router nacks it and
	// the broker redelivers it. Keep it below the broker's limit on an
	// unacknowledged delivery (RabbitMQ consumer_timeout, 30 min by
	// default). Defaults to DefaultMaxHold (25 min); negative holds until
	// the router closes.
	MaxHold time.Duration
}

// Consumer applies each event's effects once per (consumer, event_id): it is
// the only way to attach the claim to a Watermill handler, always inside the
// whole chain, outermost first: poison (and hold) → retry → recoverer →
// claim. Each attempt begins a transaction on the DB, claims the event with
// one INSERT … ON CONFLICT DO NOTHING, skips the handler on a duplicate
// (acked, counted, logged at debug), otherwise runs it with the transaction
// in its context (PgxTxFromContext, SQLTxFromContext) and commits; an error
// or panic rolls back claim and effects together. A Consumer serves one
// handler (AddConsumerHandler or AddHandler).
type Consumer struct {
	cfg    ConsumerConfig
	store  *processedstore.Store
	db     *sqldb.Handle
	chain  message.HandlerMiddleware
	idem   *inbox.Idempotent
	key    registryKey
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	handler string // the handler it serves, once attached
}

// startupTimeout bounds NewConsumer's one database round trip.
const startupTimeout = 10 * time.Second

// NewConsumer validates cfg (on a copy, with defaults) and returns the
// consumer. It reads the table's replay horizon (at most 10 s): it
// records cfg.ReplayHorizon when the table keeps none, adopts the table's
// when cfg.ReplayHorizon is 0 (none when the table keeps none: nothing is
// recorded), and fails with processed.ErrHorizonMismatch when they
// differ; the table must exist
// (processed.Migrate). On MySQL it also refuses a DB whose DSN counts found
// rows (clientFoundRows=true: the claim would read a duplicate as new),
// with the error processed.Migrate returns for it. A nil logger is
// watermill.NopLogger.
func NewConsumer(cfg ConsumerConfig, logger watermill.LoggerAdapter) (*Consumer, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	h, _ := sqldb.HandleOf(cfg.DB)
	// An unqualified table is named with the schema it resolves to now,
	// once: a handler's session-level SET search_path cannot move a later
	// claim, and the claim marks its transaction (processedstore.QualifiedTable).
	ctx, cancel := context.WithTimeout(context.Background(), startupTimeout)
	var err error
	cfg.Table, err = processedstore.QualifiedTable(ctx, h.Querier(), h.Dialect, cfg.Table)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig.DB: %w", err)
	}
	table, err := processedstore.NewStore(processedstore.Config{Table: cfg.Table, Dialect: h.Dialect, Layout: cfg.Layout})
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig: %w", err)
	}
	// The horizon lives with the table: recorded by the first consumer
	// configured with one, verified by every later one
	// (ErrHorizonMismatch), adopted when unset (none while the table
	// keeps none).
	ctx, cancel = context.WithTimeout(context.Background(), startupTimeout)
	horizon, keeps, err := table.AdoptHorizon(ctx, h.Querier(), cfg.ReplayHorizon, time.Now())
	cancel()
	switch {
	case errors.Is(err, processedstore.ErrHorizonMismatch):
		return nil, fmt.Errorf("middleware: ConsumerConfig.ReplayHorizon: %w", err)
	case err != nil:
		// The table's horizon could not be read or written: the table is
		// not migrated, or not where ConsumerConfig.Table names it.
		return nil, fmt.Errorf("middleware: ConsumerConfig.Table %s: its replay horizon cannot be read or recorded "+
			"(run processed.Migrate for this table; check the schema or search_path and the role's privileges): %w", cfg.Table, err)
	}
	cfg.ReplayHorizon = horizon
	store, err := processedstore.NewStore(processedstore.Config{
		Table: cfg.Table, Dialect: h.Dialect, Horizon: horizon,
		MaxFutureSkew: cfg.MaxFutureSkew, Layout: cfg.Layout,
		Narrowed: horizon != keeps, TableHorizon: keeps,
	})
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig: %w", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), startupTimeout)
	err = store.CheckLean(ctx, h.Querier(), cfg.Consumer)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig.DB: %w", err)
	}
	// On MySQL the claim reads a duplicate from rows affected: refuse a
	// DSN that counts found rows (clientFoundRows=true), whatever DSN the
	// migration ran on.
	ctx, cancel = context.WithTimeout(context.Background(), startupTimeout)
	err = store.CheckChangedRows(ctx, h.Std)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig.DB: %w", err)
	}
	if maxCrashes(cfg.MaxCrashes) > 0 {
		// The crash bound counts in <table>_crash: without it every count
		// fails and each attempt runs uncounted, silently.
		ctx, cancel = context.WithTimeout(context.Background(), startupTimeout)
		err = store.CheckCrashTable(ctx, h.Querier())
		cancel()
		if err != nil {
			return nil, fmt.Errorf("middleware: ConsumerConfig.MaxCrashes: %w", err)
		}
	}
	// The crash count runs outside the attempt's transaction, for counted
	// attempts only (redeliveries, a start's first ones), on h.Querier():
	// on pgx in QueryExecModeExec whatever the pool's mode (sqldb.OwnMode),
	// so it runs behind a transaction pooler too, until the claims have
	// seen a direct connection (crashQ below). In the pool's
	// cache_statement or describe_exec mode behind PgBouncer 1.18 most
	// starts and ends failed there: attempts ran uncounted, and a start
	// whose end was never written looked like a crash after a restart.
	var beginner inbox.TxBeginner
	switch {
	case cfg.JoinSQLSubscriber:
		beginner = inbox.NewSQLSubscriberBeginner()
	case h.Pgx != nil:
		beginner, err = inbox.NewPgxBeginner(h.Pgx, inbox.PgxBeginnerConfig{})
	default:
		beginner, err = inbox.NewStdBeginner(h.Std)
	}
	if err != nil {
		return nil, fmt.Errorf("middleware: ConsumerConfig.DB: %w", err)
	}
	// Over a direct connection, once the claims have seen it is one, in
	// the pool's own mode (prepared): a redelivered duplicate is this
	// statement alone (inbox.OwnQuerier).
	crashQ := inbox.OwnQuerier(beginner, h.Querier())
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: beginner, Store: store, Consumer: cfg.Consumer, LockTimeout: cfg.LockTimeout,
		Recorder: cfg.Recorder, Outbox: cfg.Outbox, OutboxTopic: cfg.OutboxTopic,
		DisablePayloadVerification: cfg.DisablePayloadVerification, Classifier: cfg.Classifier,
		MaxCrashes: maxCrashes(cfg.MaxCrashes), CrashQuerier: crashQ,
	}, logger)
	if err != nil {
		return nil, err
	}
	chain, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: cfg.Poison.Publisher, PoisonTopic: cfg.Poison.Topic,
		AfterPoison: cfg.AfterPoison, MaxRetries: cfg.Retry.MaxRetries,
		InitialInterval: cfg.Retry.InitialInterval, MaxInterval: cfg.Retry.MaxInterval,
		Multiplier: cfg.Retry.Multiplier, MaxHold: cfg.Retry.MaxHold,
		MaxHeaderBytes: cfg.Poison.MaxHeaderBytes, MaxCopiedHeaderBytes: cfg.Poison.MaxCopiedHeaderBytes,
	}, logger)
	if err != nil {
		return nil, err
	}
	return &Consumer{cfg: cfg, chain: chain, idem: idem, logger: logger, store: store, db: h,
		key: registryKey{pool: poolIdentity(h), table: store.Table().String(), consumer: cfg.Consumer}}, nil
}

// mysqlConsumerBytes is the width of the consumer column of the MySQL and
// MariaDB tables (processed, handlers, crash counts): varbinary(255).
const mysqlConsumerBytes = 255

// Validate reports the first invalid field of c, naming it: every value
// NewConsumer refuses without reading the database. (NewConsumer also
// fails on what only the database can tell: a missing table, a
// ReplayHorizon other than the table's.)
func (c ConsumerConfig) Validate() error {
	if strings.TrimSpace(c.Consumer) == "" {
		return fmt.Errorf("middleware: ConsumerConfig.Consumer %q: required, not blank (the claim key's consumer name, shared by competing workers)", c.Consumer)
	}
	h, err := sqldb.HandleOf(c.DB)
	if err != nil {
		return fmt.Errorf("middleware: ConsumerConfig.DB: %w", err)
	}
	if h.Dialect == sqldb.MySQL && len(c.Consumer) > mysqlConsumerBytes {
		// Every claim would fail with 1406 (data too long), held as
		// transient for ever.
		return fmt.Errorf("middleware: ConsumerConfig.Consumer: %d bytes, over the %d bytes of the MySQL/MariaDB processed table's consumer column (varbinary(%d))",
			len(c.Consumer), mysqlConsumerBytes, mysqlConsumerBytes)
	}
	if c.JoinSQLSubscriber && h.Dialect != sqldb.PostgreSQL {
		return fmt.Errorf("middleware: ConsumerConfig.JoinSQLSubscriber: PostgreSQL only, not %s", h.Dialect)
	}
	// The table's name and layout, as the store NewConsumer builds checks
	// them: each refusal named by the field to change.
	if err := (processedstore.Config{Table: c.Table, Dialect: h.Dialect}).Validate(); err != nil {
		return fmt.Errorf("middleware: ConsumerConfig.Table: %w", err)
	}
	if err := (processedstore.Config{Dialect: h.Dialect, Layout: c.Layout}).Validate(); err != nil {
		return fmt.Errorf("middleware: ConsumerConfig.Layout: %w", err)
	}
	if err := (processedstore.Config{Table: c.Table, Dialect: h.Dialect, Layout: c.Layout}).Validate(); err != nil {
		return fmt.Errorf("middleware: ConsumerConfig.Table (with its Layout): %w", err)
	}
	if c.ReplayHorizon < 0 {
		return fmt.Errorf("middleware: ConsumerConfig.ReplayHorizon %s: must be ≥ 0", c.ReplayHorizon)
	}
	if c.MaxFutureSkew < 0 {
		return fmt.Errorf("middleware: ConsumerConfig.MaxFutureSkew %s: must be ≥ 0", c.MaxFutureSkew)
	}
	if err := inbox.CheckLockTimeout("ConsumerConfig.LockTimeout", c.LockTimeout); err != nil {
		return err
	}
	if c.Poison.Publisher == nil {
		return errors.New("middleware: ConsumerConfig.Poison.Publisher is required")
	}
	if strings.TrimSpace(c.Poison.Topic) == "" {
		return errors.New("middleware: ConsumerConfig.Poison.Topic is required")
	}
	if c.Poison.MaxHeaderBytes != 0 && c.Poison.MaxHeaderBytes < 64 {
		return fmt.Errorf("middleware: ConsumerConfig.Poison.MaxHeaderBytes %d: at least 64", c.Poison.MaxHeaderBytes)
	}
	for i, mw := range c.AfterPoison {
		if mw == nil {
			return fmt.Errorf("middleware: ConsumerConfig.AfterPoison[%d] is nil", i)
		}
	}
	switch r := c.Retry; {
	case r.MaxRetries < 0:
		return fmt.Errorf("middleware: ConsumerConfig.Retry.MaxRetries %d: must be ≥ 0", r.MaxRetries)
	case r.Multiplier != 0 && !(r.Multiplier >= 1):
		return fmt.Errorf("middleware: ConsumerConfig.Retry.Multiplier %v: must be ≥ 1", r.Multiplier)
	case r.InitialInterval < 0:
		return fmt.Errorf("middleware: ConsumerConfig.Retry.InitialInterval %s: must be ≥ 0", r.InitialInterval)
	case r.MaxInterval < 0:
		return fmt.Errorf("middleware: ConsumerConfig.Retry.MaxInterval %s: must be ≥ 0", r.MaxInterval)
	}
	if c.Outbox == nil && c.OutboxTopic != "" {
		// Without an outbox the router publishes the returned messages to
		// the handler's publish topic after the commit: OutboxTopic would
		// be ignored, and the messages exposed to the loss window the
		// outbox closes.
		return fmt.Errorf("middleware: ConsumerConfig.OutboxTopic %q: needs ConsumerConfig.Outbox (without an outbox, "+
			"returned messages are published by the router to the handler's publish topic after the commit); "+
			"set Outbox, or leave OutboxTopic empty", c.OutboxTopic)
	}
	if c.Outbox != nil {
		oh := outboxdb.HandleOf(c.Outbox)
		if oh == nil {
			return errors.New("middleware: ConsumerConfig.Outbox: not built by outbox.New")
		}
		if oh.Dialect != h.Dialect {
			return fmt.Errorf("middleware: ConsumerConfig.Outbox: an outbox for %s, but DB is %s: its rows are written "+
				"in each attempt's transaction on DB, which cannot run %s SQL; build the outbox on DB (outbox.Config.DB)",
				oh.Dialect, h.Dialect, oh.Dialect)
		}
	}
	return nil
}

// AddConsumerHandler adds a handler that produces no messages to r, as
// Watermill's Router.AddConsumerHandler does, with the consumer's whole
// chain around h. It fails with ErrAttached on a Consumer that already
// serves a handler, with ErrSharedConsumer when another Consumer of the
// same name, pool and table serves a handler of another name in this
// process, when subscribeTopic is empty, and when it is the consumer's own
// poison topic (ConsumerConfig.Poison.Topic): a handler must not consume
// its own dead letters.
func (c *Consumer) AddConsumerHandler(r *message.Router, handlerName, subscribeTopic string,
	sub message.Subscriber, h message.NoPublishHandlerFunc) (*message.Handler, error) {
	if h == nil {
		return nil, errors.New("middleware: AddConsumerHandler: nil handler")
	}
	return c.AddHandler(r, handlerName, subscribeTopic, sub, "", nil, func(msg *message.Message) ([]*message.Message, error) {
		return nil, h(msg)
	})
}

// AddHandler adds a handler to r, as Watermill's Router.AddHandler does,
// with the consumer's whole chain around h. The messages h returns are
// written to ConsumerConfig.Outbox in the attempt's transaction (topic
// OutboxTopic, else publishTopic), or, without an outbox, published by
// the router to publishTopic on pub after the commit. Errors as
// AddConsumerHandler.
func (c *Consumer) AddHandler(r *message.Router, handlerName, subscribeTopic string, sub message.Subscriber,
	publishTopic string, pub message.Publisher, h message.HandlerFunc) (*message.Handler, error) {
	switch {
	case r == nil:
		return nil, errors.New("middleware: AddHandler: nil router")
	case sub == nil:
		return nil, errors.New("middleware: AddHandler: nil subscriber")
	case h == nil:
		return nil, errors.New("middleware: AddHandler: nil handler")
	case handlerName == "":
		return nil, errors.New("middleware: AddHandler: empty handler name")
	case subscribeTopic == "":
		// No transport consumes an empty topic: a RabbitMQ subscriber
		// binds its queue with routing key "" and receives nothing.
		return nil, fmt.Errorf("middleware: AddHandler: handler %q: empty subscribe topic", handlerName)
	case subscribeTopic == c.cfg.Poison.Topic:
		// Its poisoned messages would come back to it. The chain never
		// publishes to the topic it consumes, so it would hold each
		// message that fails there (retried in place, nacked after
		// MaxHold, redelivered) for ever, the messages behind it stalled.
		return nil, fmt.Errorf("middleware: AddHandler: handler %q subscribes to %q, consumer %q's poison topic "+
			"(ConsumerConfig.Poison.Topic): it would receive its own dead letters; consume the poison topic with a "+
			"handler outside the consumer, or give the consumer another poison topic", handlerName, subscribeTopic, c.cfg.Consumer)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.attach(handlerName); err != nil {
		return nil, err
	}
	if pub == nil && c.cfg.Outbox != nil {
		pub = outboxOnly{} // the consumer writes produced messages to its outbox; the router publishes none
	}
	var handler *message.Handler
	if pub == nil {
		handler = r.AddConsumerHandler(handlerName, subscribeTopic, sub, func(msg *message.Message) error {
			out, err := h(msg)
			if err == nil && len(out) > 0 {
				return fmt.Errorf("%w: handler %q returned %d messages but has no publisher and the consumer no outbox",
					ErrInvalidProduced, handlerName, len(out))
			}
			return err
		})
	} else {
		handler = r.AddHandler(handlerName, subscribeTopic, sub, publishTopic, pub, h)
	}
	handler.AddMiddleware(c.chain)
	return handler, nil
}

// attach records that c serves handler name (c.mu held).
func (c *Consumer) attach(name string) error {
	if c.handler != "" {
		return fmt.Errorf("%w: consumer %q serves handler %q; build one Consumer per handler", ErrAttached, c.cfg.Consumer, c.handler)
	}
	if err := register(c.key, name); err != nil {
		return err
	}
	c.handler = name
	c.idem.SetHandlerName(name) // the name outside a router (idempotencytest)
	c.reportSharedName(name)
	return nil
}

// reportSharedName records in the database that the consumer serves the
// handler name, and logs at ERROR when another name served the same
// consumer within processedstore.SharedHandlerWindow (a process this one
// cannot see: two handlers that each receive their own copy of an event
// would share a claim key). A failure to record is logged, not fatal.
func (c *Consumer) reportSharedName(name string) {
	ctx, cancel := context.WithTimeout(context.Background(), startupTimeout)
	defer cancel()
	others, err := c.store.NoteHandler(ctx, c.db.Querier(), c.cfg.Consumer, name, time.Now())
	fields := watermill.LogFields{"consumer": c.cfg.Consumer, "handler": name, "table": c.key.table}
	if err != nil {
		c.logger.Error("Could not record the consumer's handler name (run processed.Migrate)", err, fields)
		return
	}
	if len(others) > 0 {
		fields["other_handlers"] = strings.Join(others, ",")
		fields["hint"] = "if each handler receives its own copy of an event (a fan-out), give each its own ConsumerConfig.Consumer; " +
			"competing workers of one consumer use one handler name"
		c.logger.Error("Another handler name served this consumer within a day", ErrSharedConsumer, fields)
	}
}

func init() {
	door.Wrap = func(v any, name string, h message.HandlerFunc) (message.HandlerFunc, error) {
		c, ok := v.(*Consumer)
		if !ok || c == nil {
			return nil, errors.New("middleware: no consumer")
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.handler != name {
			if err := c.attach(name); err != nil {
				return nil, err
			}
		}
		return c.chain(h), nil
	}
}

// registryKey identifies a claim key space in this process: one database
// pool, one table, one consumer name.
type registryKey struct {
	pool     any
	table    string
	consumer string
}

var (
	registryMu sync.Mutex
	registry   = map[registryKey]string{} // → handler name
)

// register records that key serves handler, refusing another handler name
// for the same key (a fan-out that shares one consumer name).
func register(key registryKey, handler string) error {
	registryMu.Lock()
	defer registryMu.Unlock()
	if other, ok := registry[key]; ok && other != handler {
		return fmt.Errorf("%w: consumer %q on table %s already serves handler %q; handler %q would skip every event %q applied "+
			"(give each handler that receives its own copy of an event its own ConsumerConfig.Consumer)",
			ErrSharedConsumer, key.consumer, key.table, other, handler, other)
	}
	registry[key] = handler
	return nil
}

func maxCrashes(n int) int {
	switch {
	case n == 0:
		return DefaultMaxCrashes
	case n < 0:
		return 0 // off
	}
	return n
}

// outboxOnly is the router's publisher of a handler whose produced messages
// go to the consumer's outbox: the router is never handed one.
type outboxOnly struct{}

func (outboxOnly) Publish(string, ...*message.Message) error {
	return errors.New("middleware: produced messages go to ConsumerConfig.Outbox, not to the router")
}
func (outboxOnly) Close() error { return nil }

func poolIdentity(h *sqldb.Handle) any {
	if h.Pgx != nil {
		return h.Pgx
	}
	return h.Std
}
