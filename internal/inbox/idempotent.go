package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/sqlitefile"
	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// DefaultLockTimeout bounds how long an attempt waits for another transaction
// that holds the claim of the same event (Config.LockTimeout).
const DefaultLockTimeout = 15 * time.Second

// maxLockTimeout is the longest Config.LockTimeout. The purger keeps a row
// 5 minutes past its horizon (processedstore's purgeClaimSlack) for a
// claim that judged its replay window and then waits on that row's lock:
// a claim that waited longer could find the row purged and apply its
// event again. A minute leaves the rest of the slack to the statement
// itself. A long wait is never needed: an attempt that meets the bound is
// held and re-run in place (ErrInFlight).
const maxLockTimeout = time.Minute

// CheckLockTimeout reports what is wrong with d as a lock timeout (field
// names the configuration field), or nil: below 1ms or above
// maxLockTimeout; a negative d (the session's setting untouched) is fine.
func CheckLockTimeout(field string, d time.Duration) error {
	switch {
	case d > 0 && d < time.Millisecond:
		return fmt.Errorf("middleware: %s %s: at least 1ms (negative leaves the session's lock_timeout untouched)", field, d)
	case d > maxLockTimeout:
		return fmt.Errorf("middleware: %s %s: at most %s, well within the purger's 5-minute slack for a claim that waits (negative leaves the session's lock_timeout untouched)", field, d, maxLockTimeout)
	}
	return nil
}

// rollbackTimeout bounds a rollback issued after the message context ended.
const rollbackTimeout = 5 * time.Second

// Config configures the idempotent middleware (NewIdempotent).
type Config struct {
	// Beginner opens each attempt's transaction and claims the event in it:
	// NewPgxBeginner(pool, …) or NewStdBeginner(db). Required.
	Beginner TxBeginner

	// Store is the processed-event store (table and dialect). Defaults to
	// processedstore.NewStore(processedstore.Config{}) (table processed_event).
	Store *processedstore.Store

	// Consumer is the first half of the claim key (consumer, event_id): the
	// name of the logical consumer whose effects the middleware applies once.
	// Required; blank or whitespace-only names are refused. Competing
	// workers of one consumer (processes or handlers reading one queue) must
	// share it; two handlers that each receive their own copy of an event
	// (fan-out) use two names, and each applies it once. There is no default:
	// a default from the Watermill handler name applied events twice when two
	// processes of one consumer named their handlers differently. Keep it
	// stable across deployments: renaming it makes every retained event new
	// again. The middleware cannot see queues: one Idempotent that serves
	// two router handlers is logged at ERROR (ErrSharedConsumer), but two
	// processes configured with different names for one queue are not
	// detected (each name applies the events it receives once).
	Consumer string

	// LockTimeout bounds the wait on a claim held by another, uncommitted
	// transaction (two deliveries of one event at once), and on the claim
	// table's lock. When it expires the attempt fails with the transient
	// ErrInFlight and is retried later. It is PostgreSQL's lock_timeout for
	// the whole attempt, so a handler statement that waits longer than it
	// on a lock also fails, transiently (SQLSTATE 55P03). Defaults to
	// DefaultLockTimeout (whole milliseconds; at least 1ms, at most a
	// minute: maxLockTimeout); a negative
	// value leaves the session's lock_timeout untouched.
	//
	// How it is set. With NewPgxBeginner on a pool in
	// pgx.QueryExecModeCacheStatement (pgx's default) over a direct
	// connection, on the plain layout, it is the session's lock_timeout,
	// set once per connection, again after a handler statement that
	// names lock_timeout, RESET, set_config or pg_settings, runs what the
	// client cannot read (EXECUTE, a prepared statement's name, arguments
	// pgx writes into the text), after DISCARD ALL, and every 256 claims:
	// no statement of its own per attempt (issue 25). The connection keeps
	// it after the attempt, so other code on the same pool runs under it
	// too; a consumer with a negative LockTimeout on that pool puts the
	// session's earlier value back. A session-level change no handler
	// statement shows (inside a function or procedure the handler calls,
	// other code on the pool) bounds that connection's claims and handlers
	// by its own value until the next of those, at most 256 claims later;
	// a function that makes it on every attempt keeps its value on that
	// connection. After a handler reached tx.Conn(), whose statements the
	// claim cannot see, the claim on that connection also sets LockTimeout
	// for its own transaction in its WHERE (8k server instructions a
	// claim): only its wait for its table lock (DDL, LOCK TABLE) then
	// follows the session's value. Behind
	// a pooler (the server's process ID is not the one the connection was
	// given at startup: PgBouncer in any pool mode) and in every other
	// mode and driver it is SET LOCAL lock_timeout before the claim, in
	// the claim's round trip (in pgx's describe modes, in a round trip
	// before it: pgx describes the claim first, which takes its table's
	// lock): the session's own value is back after the attempt. The
	// consumer's prepared statements are prepared inside a transaction
	// with it set. Never a set_config inside the claim: the executor takes
	// the claim's table lock before it evaluates any expression.
	LockTimeout time.Duration

	// Recorder receives one outcome per attempt (metrics). Defaults to none.
	Recorder Recorder

	// ReplayHorizon is deprecated: set processedstore.Config.Horizon on Store.
	// The claim statement itself refuses an event older than that horizon
	// by the database clock (OutcomeExpired, permanent), the same clock and
	// event time the purger deletes by, so no clock skew can let a purged
	// event be applied again. When > 0 it must equal the store's horizon
	// (NewIdempotent checks), and it changes nothing else.
	ReplayHorizon time.Duration

	// Now is deprecated and unused: ages are judged by the database clock.
	Now func() time.Time

	// Outbox, when set (recommended), makes the messages a handler produces
	// part of its transaction: those it returns, and those it publishes
	// through PublisherFromContext, are written to this outbox in the same
	// transaction as the claim and the effects, and the middleware returns
	// none to the router. A relay (outbox.NewRelay) publishes them after the
	// commit, at least once, each with the event_id it was written with.
	// Without an outbox, returned messages go back to the router, which
	// publishes them after the commit: a crash or a failed publish in between
	// loses them (the redelivery is a duplicate and produces nothing).
	Outbox *outbox.Outbox

	// DisablePayloadVerification turns off the check of duplicates against
	// what was applied. With it on (the default), the claim also stores the
	// event's name and a fingerprint of its name and payload bytes
	// (processedstore.NewIdentity; needs processed migration 0003), and a
	// duplicate is compared with the row it collided with: equal, or a row
	// without fingerprint (written before the migration), → a duplicate as
	// always; different → another event under a reused event_id, refused as
	// permanent (ErrEventIDReused, reason "event_id_reused", OutcomeConflict,
	// logged at error with both event names), so it reaches the poison topic
	// once instead of being acked unseen. A new event pays the hash (about
	// 1.2 µs for a 200-byte payload, processedstore.BenchmarkNewIdentity) and
	// ~45 bytes more per row, in the same single INSERT (measured with
	// BenchmarkPayloadVerification, messages alternating on one table: new
	// events verified/plain 0.94-1.02, no difference beyond noise; bench
	// part 6: 7.7k client instructions and 4 allocations per message, 48 B
	// of WAL); a duplicate pays a primary-key read, sent in one round trip
	// with its ROLLBACK on the pgx beginner (one more statement, no more
	// round trips; other beginners: one more round trip). Rows
	// written before the migration have no fingerprint and stay plain
	// duplicates. Run processed migration 0003 before deploying a release
	// with verification on: without the columns every claim fails (and is
	// retried, never acked). Defaults to false (verification on).
	DisablePayloadVerification bool

	// OutboxTopic is the destination topic of returned messages written to
	// the outbox. Defaults to the handler's publish topic
	// (message.PublishTopicFromCtx).
	OutboxTopic string

	// Classifier classifies, by code, database errors of a driver the
	// middleware does not link, when they come out of an attempt (claim,
	// handler statements on the attempt's transaction, commit): set
	// mysqlerr.Classify with go-sql-driver/mysql (MySQL, MariaDB).
	// PostgreSQL SQLSTATEs need none (see ClassOf). Defaults to none: MySQL
	// errors of the middleware's own calls are then infrastructure by
	// origin, and those of the handler ordinary.
	Classifier ErrorClassifier

	// MaxCrashes bounds how many attempts of a redelivered message may start
	// and never end (the process died in them) before the message is
	// rejected as permanent (ErrCrashLoop); counted in the store's _crash
	// table on CrashQuerier (autocommit), for redeliveries only. 0: off.
	MaxCrashes int
	// CrashQuerier runs the statements outside an attempt's transaction
	// (autocommit): the crash count, and the read that ends a duplicate of
	// a run of duplicates (duplicateRun). nil: neither.
	CrashQuerier sqldb.Querier
}

func (c *Config) setDefaults() error {
	if c.Store == nil {
		s, err := processedstore.NewStore(processedstore.Config{})
		if err != nil {
			return err
		}
		c.Store = s
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if c.Recorder == nil {
		c.Recorder = nopRecorder{}
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return nil
}

// Validate reports the first invalid field of c, naming it.
func (c Config) Validate() error {
	if c.Beginner == nil {
		return errors.New("middleware: Config.Beginner is required (NewPgxBeginner or NewStdBeginner)")
	}
	if strings.TrimSpace(c.Consumer) == "" {
		if c.Consumer == "" {
			return fmt.Errorf("middleware: Config.Consumer is required (the claim key's consumer name, shared by competing workers): %w", ErrNoConsumer)
		}
		return fmt.Errorf("middleware: Config.Consumer %q: blank name: %w", c.Consumer, ErrNoConsumer)
	}
	if c.ReplayHorizon < 0 {
		return fmt.Errorf("middleware: Config.ReplayHorizon %s: must be ≥ 0", c.ReplayHorizon)
	}
	if err := CheckLockTimeout("Config.LockTimeout", c.LockTimeout); err != nil {
		return err
	}
	return nil
}

// Idempotent is the idempotent-consumer (inbox) middleware. See Middleware.
type Idempotent struct {
	cfg         Config
	logger      watermill.LoggerAdapter
	lockTimeout *lockTimeoutStmt // built once from cfg.LockTimeout
	// outside is the beginner's database outside any attempt
	// (DBFromContext), built once; nil when the beginner has none.
	outside sqldb.Querier

	// quiet: the logger is Watermill's NopLogger, so no log field is built.
	quiet bool

	// warmup counts the first attempts since the middleware was built whose
	// crashes are counted though the broker did not mark them redelivered
	// (countsCrashes), of events not processed yet: a re-read of events
	// applied before the crash takes none.
	warmup atomic.Int64
	// lanes are the partitions of a transport that sets wire.Position and
	// where this process last committed an attempt of a new event in each
	// (countsCrashes).
	lanes laneMarks
	// uncountedOnce logs the first uncounted delivery (uncounted).
	uncountedOnce sync.Once

	// name is the handler the consumer was attached to (SetHandlerName),
	// its name outside a router.
	name atomic.Pointer[string]

	// unrecorded are the attempts this process ended whose end could not
	// be written (the database was away when EndAttempt ran), or whose
	// start failed but may have been written, by (consumer, event id): the
	// next attempt of any event writes them first (payOwedEnds), so an
	// outage is never taken for a crash, even when the delivery it held
	// went on to another process.
	unrecorded unrecordedEnds

	// dupShare is the share of duplicates among the consumer's recent
	// claims, a moving average in 1/dupScale (duplicateRun).
	dupShare atomic.Int32
}

// unrecordedEnds are the ends of attempts this process ran whose end
// could not be written, by (consumer, event id), with how many each: at
// most maxUnrecordedEnds events (past it an end is not remembered, and its
// event's count keeps that start, as a crash would).
type unrecordedEnds struct {
	mu    sync.Mutex
	count map[crashKey]int
	// n is the number of ends owed, read without the lock by every attempt.
	n atomic.Int32
}

type crashKey struct {
	consumer string
	id       uuid.UUID
}

const maxUnrecordedEnds = 4096

// add owes one more end of k.
func (u *unrecordedEnds) add(k crashKey) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.count == nil {
		u.count = make(map[crashKey]int)
	}
	if u.count[k] > 0 || len(u.count) < maxUnrecordedEnds {
		u.count[k]++
		u.n.Add(1)
	}
}

// take removes one owed end, of k when only is set, and reports whether
// there was one: the caller writes it, and adds it back when the write
// fails. Two attempts never write the same owed end.
func (u *unrecordedEnds) take(k crashKey, only bool) (crashKey, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !only {
		for key := range u.count {
			k = key
			break
		}
	}
	if u.count[k] == 0 {
		return k, false
	}
	if u.count[k]--; u.count[k] == 0 {
		delete(u.count, k)
	}
	u.n.Add(-1)
	return k, true
}

// SetHandlerName records the name of the handler the consumer serves: the
// attempts' handler name (logs, observations, dead letters) when the
// message context has none from Watermill's router (idempotencytest).
func (m *Idempotent) SetHandlerName(name string) { m.name.Store(&name) }

// handlerNameOf is the router's handler name in ctx, else SetHandlerName's;
// "" when neither is set.
func (m *Idempotent) handlerNameOf(ctx context.Context) string {
	if n := message.HandlerNameFromCtx(ctx); n != "" {
		return n
	}
	if n := m.name.Load(); n != nil {
		return *n
	}
	return ""
}

// countedTurns lets one counted attempt of a redelivery the broker marks
// (countsCrashes, markedRedelivery) at a time run in the process,
// whatever the consumer: a process that dies with several counted attempts
// in flight counts a crash for each, and a healthy message handled beside
// the one that kills the process would be dead-lettered with it. First
// deliveries, which count nothing, run beside it, and so do the warm-up
// attempts of a transport that marks nothing (Kafka; GoChannel, whose
// handlers may wait for each other through a blocking publish): there a
// crash counts every one in flight. An attempt nested in another
// consumer's attempt of the same delivery runs in its outer one's turn, and
// one that joins watermill-sql's subscriber transaction takes none: that
// transaction spans the attempts of its batch, and an attempt holding the
// turn could wait for a lock it holds while it waits for the turn.
var countedTurns = make(chan struct{}, 1)

// countedTurnWait bounds the wait for countedTurns: past it the attempt
// runs beside the counted one (logged), so a handler that waits for another
// counted attempt of the same process never deadlocks; a crash then counts
// every counted attempt in flight.
var countedTurnWait = func() *atomic.Int64 {
	var d atomic.Int64
	d.Store(int64(time.Minute))
	return &d
}()

// countedTurn waits for the process's counted attempt slot (countedTurns)
// and returns its release. The message context ending first fails the
// attempt as transient: the delivery is given back.
func (m *Idempotent) countedTurn(ctx context.Context, fields watermill.LogFields) (release func(), err error) {
	select {
	case countedTurns <- struct{}{}:
		return func() { <-countedTurns }, nil
	default:
	}
	wait := time.Duration(countedTurnWait.Load())
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case countedTurns <- struct{}{}:
		return func() { <-countedTurns }, nil
	case <-t.C:
		m.logger.Info("Counted attempt runs beside another one of this process (waited "+wait.String()+
			"): a crash now counts every counted attempt in flight", fields)
		return func() {}, nil
	case <-ctx.Done():
		return nil, &InfrastructureError{Op: "wait for the process's counted attempt", Err: ctx.Err()}
	}
}

// crashWarmup is how many attempts after a consumer starts are counted as
// possible crashes on transports that mark no redelivery (Kafka, Redis
// Streams without CountingClient): a message that killed the process is
// among the first a restarted consumer receives (Kafka resumes at the
// committed offset). Later first deliveries write nothing, but those of a
// transport that gives each record's place in its partition
// (wire.Position) that laneMarks counts.
const crashWarmup = 64

// laneMarks are, per partition of a transport that sets wire.Position, the
// offset of the last record whose attempt of an event not processed yet
// committed in this process; a failed attempt of a new event clears it.
// Past the warm-up, the record right after it is not counted; any other
// is: the first record of a partition after a start, a reassignment or a
// replay of records another member applied, and any record after a failed
// attempt, the same record given back included (a retry in the process, a
// held delivery nacked: the attempt that dies may be that one).
// The record that killed the last member is such a record (Kafka resumes
// each partition at its uncommitted record), however many records of
// other partitions come first: the warm-up alone missed it behind the
// first records of many partitions. One case is not: a partition that went
// to another member, which died on its next record, and came back to the
// member that applied the record before it, whose mark still stands; that
// member dies once uncounted, and its restart forgets the mark. A gap in
// the offsets (a transaction's marker, compaction) costs one counted
// attempt. A mark is not timed: a partition quiet for a while would
// otherwise have each of its records counted, one at a time in the
// process.
type laneMarks struct {
	mu   sync.Mutex
	last map[string]int64
}

// position is a record's place in its partition (wire.Position); ok is
// false when its transport gives none.
type position struct {
	lane string
	off  int64
	ok   bool
}

// positionOf reads msg's position, once per attempt.
func positionOf(msg *message.Message) position {
	lane, off, ok := wire.ParsePosition(msg.Metadata.Get(wire.Position))
	return position{lane: lane, off: off, ok: ok}
}

// follows reports whether the record at p is the next one after the last
// one in its lane whose attempt of a new event this process committed.
func (l *laneMarks) follows(p position) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	last, ok := l.last[p.lane]
	return ok && p.off == last+1
}

// ended records that an attempt of a new event at p ended: committed, it
// is its lane's mark; failed, the lane has none.
func (l *laneMarks) ended(p position, committed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !committed {
		delete(l.last, p.lane)
		return
	}
	if l.last == nil {
		l.last = make(map[string]int64)
	}
	l.last[p.lane] = p.off
}

// isNopLogger reports whether l is Watermill's NopLogger (it logs nothing).
func isNopLogger(l watermill.LoggerAdapter) bool {
	switch l.(type) {
	case watermill.NopLogger, *watermill.NopLogger:
		return true
	}
	return false
}

// setField sets k in f unless f is nil (no fields are built for a quiet
// logger).
func setField(f watermill.LogFields, k string, v any) {
	if f != nil {
		f[k] = v
	}
}

// NewIdempotent validates cfg (on a copy with defaults applied) and returns
// the middleware. A nil logger is watermill.NopLogger. On SQLite
// (NewStdBeginner with a SQLite Store) it reads the handle's database file
// (one query) and refuses, with an error wrapping sqldb.ErrSharedSQLiteFile
// naming operation.Config.DB, a file that an operation.Runner built in this
// process records its operations in (SQLite has one writer per file; see
// operation.Config.DB).
func NewIdempotent(cfg Config, logger watermill.LoggerAdapter) (*Idempotent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if err := checkHorizon(cfg); err != nil {
		return nil, err
	}
	if _, pgxOnly := cfg.Beginner.(*pgxBeginner); pgxOnly && cfg.Store.Dialect() != sqldb.PostgreSQL {
		return nil, fmt.Errorf("middleware: Config.Beginner: the pgx beginner needs a PostgreSQL store, not %s (use NewStdBeginner)", cfg.Store.Dialect())
	}
	if err := registerSQLiteInbox(cfg); err != nil {
		return nil, err
	}
	m := &Idempotent{cfg: cfg, logger: logger, lockTimeout: newLockTimeoutStmt(cfg.Store, cfg.LockTimeout),
		quiet: isNopLogger(logger)}
	if o, ok := cfg.Beginner.(interface{ outside() sqldb.Querier }); ok {
		m.outside = o.outside()
	}
	return m, nil
}

// registerSQLiteInbox records, on SQLite, the database file of the
// beginner's handle as the file of the middleware's transactions, and
// refuses it (wrapping sqldb.ErrSharedSQLiteFile) when an operation.Runner
// built in this process records its operations in the same file: the
// Runner, called from a handler, could never commit its started record
// while the attempt's transaction holds the file's write lock.
func registerSQLiteInbox(cfg Config) error {
	b, ok := cfg.Beginner.(*stdBeginner)
	if !ok || cfg.Store.Dialect() != sqldb.SQLite {
		return nil
	}
	path, err := sqlitefile.Register(b.db, sqlitefile.Inbox)
	if errors.Is(err, sqldb.ErrSharedSQLiteFile) {
		return fmt.Errorf("middleware: Config.Beginner: the SQLite file %s is the database of an operation.Runner "+
			"(operation.Config.DB) in this process; the Runner, called from a handler, commits its records while the "+
			"attempt's transaction holds this file's write lock: open operation.Config.DB on a database file of its own "+
			"and run Runner.Migrate there: %w", path, err)
	}
	if err != nil {
		return fmt.Errorf("middleware: Config.Beginner: %w", err)
	}
	return nil
}

// Middleware wraps h so that its effect is applied once per (consumer,
// event_id), however often the message is delivered. Per attempt:
//
//  0. Inside an attempt of the same consumer (the middleware wrapped twice
//     around one handler, e.g. a router-level chain plus a handler-level
//     one), it fails at once with a ConfigurationError ("runs twice"):
//     its claim would only wait for the outer attempt's own claim.
//  1. A message flagged malformed by the marshaler, or whose msg.UUID is not
//     a non-nil UUID, fails with a PermanentError before any SQL runs.
//  2. A transaction is begun and (consumer, event_id) claimed in it with one
//     INSERT … ON CONFLICT DO NOTHING (pipelined with BEGIN on pgx).
//  3. Zero rows: a duplicate. The transaction is rolled back, h is not
//     called, nil is returned (the router acks); logged at debug, recorded
//     as OutcomeDuplicate.
//  4. One row: h runs with the transaction in its context (PgxTxFromContext,
//     SQLTxFromContext, QuerierFromContext). The messages it produces (those
//     it returns, and with Config.Outbox those it publishes through
//     PublisherFromContext) are checked (ErrInvalidProduced) and, with an
//     outbox, written to it in the transaction. Then the transaction
//     commits; a commit that did not commit is an error wrapping ErrCommit.
//
// A failed attempt leaves nothing: if h returns an error or panics, a
// produced message is invalid, the outbox write fails or panics, or the
// commit fails, the transaction is rolled back (claim, effects and outbox
// rows vanish together), no message is returned (so a PoisonQueue outside
// that turns the error into an ack publishes none either), and the error is
// returned, or the panic re-raised, for Retry, PoisonQueue and Recoverer.
//
// The message's context is restored after the attempt, the connection is
// returned to its pool on every path (panics included: one deferred cleanup
// ends every attempt), and each attempt (the chain's retry calls the middleware
// again with the same message) gets a fresh transaction. Without an outbox,
// the messages h returns are returned after the commit, for the router to
// publish: a crash between the commit and that publish loses them.
//
// It is wired only by middleware.NewConsumer, inside the whole chain
// (NewHandlerMiddleware): no other wiring can be written from outside.
func (m *Idempotent) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return m.middleware(h)
}

// middleware is one attempt: see Middleware.
func (m *Idempotent) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (_ []*message.Message, err error) {
		start := time.Now()
		origCtx := msg.Context()
		consumer := m.cfg.Consumer
		attempt := nextAttempt(msg)
		handlerName := m.handlerNameOf(origCtx)
		// Log fields are built only for a logger that logs (a NopLogger
		// gets none).
		var fields watermill.LogFields
		if !m.quiet {
			fields = attemptFields(msg, consumer, handlerName, attempt)
		}
		reject := func(o Outcome, reason string, err error) ([]*message.Message, error) {
			return nil, m.finish(handlerName, o, start, 0, fields, permanent(reason, err))
		}
		if m.unrecorded.n.Load() > 0 {
			m.payOwedEnds(origCtx)
		}
		outer, nested := stateFrom(origCtx)
		if nested && outer.consumer == consumer {
			// Wired twice (by hand, or a router-level chain plus a
			// handler-level one): this claim would wait for the outer
			// attempt's uncommitted claim of the same key, forever.
			return nil, m.finish(handlerName, OutcomeFailed, start, 0, fields, wiredTwice(consumer))
		}
		if reason, bad := marshaler.Malformed(msg); bad {
			// msg.UUID is the transport's message id here, not an event id.
			delete(fields, "event_id")
			setField(fields, "transport_message_id", msg.UUID)
			return reject(OutcomeRejected, "malformed", fmt.Errorf("%w: %s", ErrMalformed, reason))
		}
		if _, undecoded := msg.Metadata[wire.EnvelopeHeader]; undecoded {
			// Published by an adapter, received through Watermill's default
			// unmarshaler: the payload is the envelope. Held until the
			// wiring is fixed; the handler never sees it.
			return nil, m.finish(handlerName, OutcomeFailed, start, 0, fields, undecodedEnvelope())
		}
		eventID, perr := marshaler.ParseEventID(msg.UUID) // the marshaler's strict forms, never uuid.Parse's lenient ones
		if perr != nil {
			delete(fields, "event_id")
			setField(fields, "transport_message_id", msg.UUID)
			if msg.UUID == "" {
				// No adapter decoded it (an adapter marks a body without an
				// event_id Malformed): the subscriber's marshaler is not the
				// transport's envelope adapter, and every message would be
				// dead-lettered. Held until the wiring is fixed.
				return nil, m.finish(handlerName, OutcomeFailed, start, 0, fields, invalidEventID(msg.UUID))
			}
			return reject(OutcomeRejected, "invalid_event_id", invalidEventID(msg.UUID))
		}
		if !m.quiet {
			fields["event_id"] = eventID.String()
		}
		// The replay window is the claim's (the database clock, see
		// retention.go): no expiry check runs here on the process clock.

		// A record of a partitioned transport (wire.Position): once an
		// attempt that claimed it (an event not processed yet) committed in
		// this process, the partition's next record follows it and is not
		// counted. A duplicate marks nothing (the record before it may have
		// been another member's). A failed attempt clears the partition's
		// mark: the same record given back (a retry) is counted, and every
		// member that held the partition while the record failed does not
		// take the next one, which may kill it, for a record following its
		// own.
		var fresh bool
		pos := positionOf(msg)
		if pos.ok {
			defer func() {
				if fresh {
					m.lanes.ended(pos, err == nil)
				}
			}()
		}
		counted, marked := m.countsCrashes(msg, pos)
		if !counted {
			if m.duplicateRun(origCtx, nested) {
				if stored, found := m.processedBefore(origCtx, consumer, eventID); found {
					return nil, m.endProcessed(msg, consumer, handlerName, eventID, stored, start, fields)
				}
			}
			return m.attempt(h, msg, origCtx, consumer, handlerName, eventID, start, fields, nil, &fresh)
		}
		// Counted attempts of marked redeliveries and of partitioned records
		// (wire.Position) run one at a time in the process: otherwise the
		// records of other partitions in flight when the poisoned one kills
		// the process are counted as crashes with it, come first again after
		// each restart, and are dead-lettered as a crash loop beside it. The
		// warm-up of a transport that marks nothing and has no partitions
		// (GoChannel) does not: its handlers may wait for each other through
		// a blocking publish.
		if _, joined := wsql.TxFromContext(origCtx); (marked || pos.ok) && !nested && !joined {
			release, werr := m.countedTurn(origCtx, fields)
			if werr != nil {
				return nil, m.finish(handlerName, OutcomeFailed, start, 0, fields, werr)
			}
			defer release()
		}
		started, stored, sent, cerr := m.startAttempt(origCtx, consumer, eventID)
		if !stored.Found && !marked {
			m.warmup.Add(1) // one of the warm-up attempts (countsCrashes)
		}
		if cerr != nil {
			// The database is unreachable: the attempt runs uncounted and
			// will say so. A start that was sent may have been written all
			// the same (it committed and its answer was lost on a breaking
			// connection), so it is ended with the attempt (and owed when
			// that fails too). Otherwise each such start of a delivery held
			// through a flapping database stayed counted as a crash, and
			// the event was dead-lettered as a crash loop.
			if sent {
				defer m.endAttempt(origCtx, consumer, eventID)
			}
			return m.attempt(h, msg, origCtx, consumer, handlerName, eventID, start, fields, nil, &fresh)
		}
		if stored.Found {
			// A redelivery of a processed event: nothing was counted and
			// no transaction is needed (its identity was read with the
			// count's statement).
			return nil, m.endProcessed(msg, consumer, handlerName, eventID, stored, start, fields)
		}
		// The count ends with the attempt on every path but the process's
		// death (a panic unwinds through here too), and a claim over the
		// crash bound that failed (overCrashBound): its retry must still
		// find the message over the bound.
		// A processed attempt ends it in its own transaction (attempt),
		// so a process that dies after the commit leaves no count.
		keep, endedInTx := false, false
		defer func() {
			switch {
			case keep || endedInTx:
			case err == nil:
				// Processed (or a duplicate): the count's earlier
				// starts do not matter any more. Here when the commit
				// could not take it (watermill-sql's subscriber
				// transaction).
				m.forgetAttempts(origCtx, consumer, eventID)
			default:
				// Failed: one less. Dead-lettered by the chain
				// afterwards (a permanent error, retries exhausted),
				// the count is deleted, so that a redrive of it starts
				// afresh.
				m.endAttempt(origCtx, consumer, eventID)
				onPoisoned(origCtx, crashKey{consumer, eventID}, func(ctx context.Context) { m.forgetAttempts(ctx, consumer, eventID) })
			}
		}()
		crashed := crashedAttempts(msg, started)
		if crashed >= m.cfg.MaxCrashes {
			setField(fields, "crashed_attempts", crashed)
			keep, err = m.overCrashBound(msg, origCtx, consumer, handlerName, eventID, start, fields, crashed)
			return nil, err
		}
		if crashed+1 >= m.cfg.MaxCrashes {
			// The last attempt the bound lets run: should the process die
			// in it, the next delivery is dead-lettered without running
			// the handler (LastAttemptBeforeCrashLoop).
			defer msg.SetContext(origCtx)
			attemptCtx := context.WithValue(origCtx, lastBeforeCrashLoopKey{}, consumer)
			msg.SetContext(attemptCtx)
			return m.attempt(h, msg, attemptCtx, consumer, handlerName, eventID, start, fields, &endedInTx, &fresh)
		}
		return m.attempt(h, msg, origCtx, consumer, handlerName, eventID, start, fields, &endedInTx, &fresh)
	}
}

// lastBeforeCrashLoopKey marks the context of an attempt that is the last
// one the crash bound lets run (LastAttemptBeforeCrashLoop); its value is
// the attempt's consumer, so that an attempt of another consumer nested in
// it (whose context is built on this one) is not taken for its last.
type lastBeforeCrashLoopKey struct{}

// LastAttemptBeforeCrashLoop reports, inside a handler run by the
// middleware, whether this attempt is the last one Config.MaxCrashes lets
// run: its earlier attempts died MaxCrashes−1 times, so if the process dies
// in this one too, the next delivery is dead-lettered as a crash loop
// without running the handler (nor anything inside the middleware). It is
// the innermost attempt's answer: inside consumers nested around one
// handler, the attempt of the consumer closest to the handler. A step
// that must run before a message is dead-lettered, such as the family
// filter's retirement (versioned.LatestFilter), runs then, at once: it gets
// no later chance. False outside the middleware and on attempts that are
// not counted (MaxCrashes off, a first delivery on a transport that marks
// redeliveries, an attempt whose start could not be written).
func LastAttemptBeforeCrashLoop(ctx context.Context) bool {
	st, ok := stateFrom(ctx)
	if !ok {
		return false
	}
	consumer, marked := ctx.Value(lastBeforeCrashLoopKey{}).(string)
	return marked && consumer == st.consumer
}

// overCrashBound ends an attempt whose earlier attempts died at least
// MaxCrashes times. The claim runs first, without the handler: an event
// processed already (its row where only the claim looks, such as the legacy
// table of processed.MigrateToPartitioned) is a duplicate, or a conflict,
// as on any other path, never a crash loop. Otherwise the claim is rolled
// back and the message rejected as permanent (reason "crash_loop",
// ErrCrashLoop). A claim that fails (the database went away, or the lock
// timeout ran out on a claim another copy holds) fails the attempt: it is
// retried, never dead-lettered on an error, and keep is set (so too when
// the statements after a claim that inserted nothing fail): the count is
// not ended, so the crashes counted stay counted and the retry is over the
// bound too (ending it forgot them, and the retry ran the handler of a
// message that kept killing the process). A crash-loop rejection keeps the
// count too, inside the chain, until the chain has dead-lettered the
// message (onPoisoned): a delivery given back to the broker instead (the
// poison publish failed until MaxHold) is still over the bound.
func (m *Idempotent) overCrashBound(msg *message.Message, origCtx context.Context, consumer, handlerName string,
	eventID uuid.UUID, start time.Time, fields watermill.LogFields, crashed int) (keep bool, _ error) {
	eventAt, _ := eventTime(msg, eventID)
	req := claimRequest{store: m.cfg.Store, consumer: consumer, eventID: eventID, eventAt: eventAt, lockTimeout: m.lockTimeout}
	req.identity, req.verify = m.identityOf(msg)
	tx, claimed, err := m.cfg.Beginner.beginClaim(origCtx, req)
	claimDur := time.Since(start)
	if err != nil {
		err = m.finish(handlerName, OutcomeFailed, start, claimDur, fields,
			fmt.Errorf("idempotency: begin and claim %s/%s: %w", consumer, eventID, claimError(err, m.cfg.Classifier)))
		return !IsPermanent(err), err
	}
	defer tx.release()
	if !claimed {
		err := m.unclaimed(origCtx, tx, req, handlerName, start, claimDur, fields)
		return err != nil && !IsPermanent(err), err // a read after the claim failed: retried
	}
	_ = rollback(origCtx, tx)
	// Rejected as a crash loop: the count ends once the message is
	// dead-lettered, not before. A poison publish that fails until MaxHold
	// (or a shutdown) gives the delivery back to the broker, and its next
	// delivery must still be over the bound instead of running the handler.
	keep = onPoisoned(origCtx, crashKey{consumer, eventID}, func(ctx context.Context) { m.forgetAttempts(ctx, consumer, eventID) })
	return keep, m.finish(handlerName, OutcomeRejected, start, claimDur, fields, permanent("crash_loop", fmt.Errorf("%w: %d attempts of this message started "+
		"and never ended (the process died in them: out of memory, a fatal error, a liveness probe); at most %d", ErrCrashLoop, crashed, m.cfg.MaxCrashes)))
}

// wiredTwice is the error of an attempt nested in an attempt of the same
// consumer (see Middleware, step 0).
func wiredTwice(consumer string) error {
	return &ConfigurationError{
		Hint: "wire the idempotent middleware of a consumer once per handler: use middleware.NewHandlerMiddleware on the handler " +
			"and no router-level chain or Idempotent.Middleware besides",
		Err: fmt.Errorf("idempotency: the idempotent middleware of consumer %q runs twice around one handler (nested attempt)", consumer),
	}
}

// attemptFields are the log fields of an attempt (built only for a logger
// that logs).
func attemptFields(msg *message.Message, consumer, handlerName string, attempt int) watermill.LogFields {
	fields := make(watermill.LogFields, 8)
	fields["event_id"] = msg.UUID
	fields["event_name"] = marshaler.EventName(msg)
	fields["consumer"] = consumer
	fields["handler_name"] = handlerName
	fields["attempt"] = attempt
	return fields
}

// countsCrashes reports whether msg's attempts are counted: a bound is set
// and either the transport marks redeliveries (the redelivered flag or a
// delivery count is present: AMQP, JetStream, Redis Streams through
// redisstream.CountingClient) and this is one (redelivered, or a delivery count above
// 0), or it marks none (Kafka) and the consumer has just started
// (crashWarmup) or, when the transport gives the record's place in its
// partition (pos, wire.Position: Kafka), this process did not just commit
// an attempt of a new event at the record before it (laneMarks). First
// deliveries on a transport that marks redeliveries write nothing. An
// uncounted delivery (uncounted) and an attempt joined to watermill-sql's
// subscriber transaction are counted at every attempt. marked reports a
// counted attempt that takes none of the warm-up (and the process's
// counted turn unless it is joined: its batch runs one message at a
// time): a marked redelivery, an uncounted delivery (it may be the claim
// of the entry that killed the last consumer), a joined attempt.
func (m *Idempotent) countsCrashes(msg *message.Message, pos position) (counted, marked bool) {
	if m.cfg.MaxCrashes <= 0 || m.cfg.CrashQuerier == nil {
		return false, false
	}
	if markedRedelivery(msg) {
		n, _ := marshaler.DeliveryCount(msg)
		return marshaler.Redelivered(msg) || n > 0, true
	}
	if m.uncounted(msg) {
		return true, true
	}
	if _, joined := m.cfg.Beginner.(sqlSubscriberBeginner); joined {
		// Joined to watermill-sql's subscriber transaction: a death rolls
		// back the whole batch, so every attempt before the killer in it
		// is an attempt of a new event again after each restart, and 64
		// or more of them spent the warm-up before the killer's turn
		// (the messages carry no redelivery mark and no position).
		return true, true
	}
	warm := m.warmup.Load() < crashWarmup
	if pos.ok && !warm {
		return !m.lanes.follows(pos), false
	}
	// Peeked, not taken: an attempt of an event already processed (a
	// Kafka member re-reading what it applied since its last committed
	// offset) gives it back below.
	return warm, false
}

// uncounted reports whether msg's adapter marked it uncounted
// (wire.UncountedDelivery: a Redis Streams entry read without
// redisstream.CountingClient, a first read and a claim of a pending entry
// alike). Every attempt of such a delivery is counted and takes the
// process's counted turn, as a marked redelivery does: the warm-up's first
// attempts would not bound a crash loop there, because a restarted consumer
// reads new entries before it claims the one that killed the last. The
// first such delivery says so in an INFO line (two more writes per
// delivery, one counted attempt at a time in the process).
func (m *Idempotent) uncounted(msg *message.Message) bool {
	if msg.Metadata.Get(wire.UncountedDelivery) == "" {
		return false
	}
	m.uncountedOnce.Do(func() {
		m.logger.Info("idempotency: Redis Streams entries read without redisstream.CountingClient: every attempt is counted for the crash bound "+
			"(two writes more per delivery) and counted attempts run one at a time in the process; "+
			"wrap the Subscriber's client with redisstream.CountingClient to count only redeliveries", watermill.LogFields{"consumer": m.cfg.Consumer})
	})
	return true
}

// markedRedelivery reports whether msg's transport marks redeliveries
// (the redelivered flag or a delivery count is present), so that its
// counted attempts are redeliveries and take the process's turn
// (countedTurns); the warm-up attempts of a transport that marks nothing
// do not.
func markedRedelivery(msg *message.Message) bool {
	_, hasFlag := msg.Metadata[marshaler.MetadataRedelivered]
	_, hasCount := marshaler.DeliveryCount(msg)
	return hasFlag || hasCount
}

// crashedAttempts is how many earlier attempts of msg died: started, the
// durable count of attempts begun and never ended (this one included), less
// this one, and never more than the broker's count of earlier deliveries
// where it has one (a quorum queue's x-delivery-count, JetStream's
// NumDelivered - 1, Redis Streams' delivery count - 1), so that a count
// left behind is never taken for crashes. The broker's count alone is not
// the crash count: it also counts deliveries buffered behind a crashing
// message and never handled (a JetStream pull batch, an AMQP prefetch) and
// deliveries given back at a shutdown or after a hold, and those did not
// crash. On a transport that marks redeliveries the first delivery wrote
// nothing, so its crash is not among them.
func crashedAttempts(msg *message.Message, started int) int {
	crashed := started - 1
	if n, ok := marshaler.DeliveryCount(msg); ok && n < int64(crashed) {
		return int(n)
	}
	return crashed
}

// startAttempt writes the start of an attempt of (consumer, id) and
// returns the attempts started and not ended, this one included; or, when
// the event is already processed, writes nothing and returns its stored
// identity (Found). An end
// this process could not write (endAttempt) is written first; while it
// cannot be, the start is not written either (an error: the attempt runs
// uncounted).
func (m *Idempotent) startAttempt(ctx context.Context, consumer string, id uuid.UUID) (started int, stored processedstore.StoredIdentity, sent bool, err error) {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	k := crashKey{consumer, id}
	if _, owed := m.unrecorded.take(k, true); owed {
		if err := m.cfg.Store.EndAttempt(c, m.cfg.CrashQuerier, consumer, id); err != nil {
			m.unrecorded.add(k)
			return 0, stored, false, err
		}
	}
	return m.cfg.Store.StartAttemptUnlessProcessed(c, m.cfg.CrashQuerier, consumer, id)
}

// endProcessed ends the attempt of a message whose event
// startAttempt or processedBefore found processed: a duplicate (nil: acked, the handler
// not called), or, with payload verification, a conflict when the stored
// fingerprint is another event's (permanent, reason "event_id_reused"), as
// the claim's duplicate path decides (endDuplicate).
func (m *Idempotent) endProcessed(msg *message.Message, consumer, handlerName string, eventID uuid.UUID,
	stored processedstore.StoredIdentity, start time.Time, fields watermill.LogFields) error {
	req := claimRequest{store: m.cfg.Store, consumer: consumer, eventID: eventID}
	req.identity, req.verify = m.identityOf(msg)
	if conflict, err := m.compareIdentity(req, stored, fields); conflict {
		return m.finish(handlerName, OutcomeConflict, start, 0, fields, permanent("event_id_reused", err))
	}
	_ = m.finish(handlerName, OutcomeDuplicate, start, 0, fields, nil)
	return nil
}

// payOwedEnds writes the ends this process owes (unrecorded), each once,
// stopping at the first that fails (the database is still away). Each
// takes one start off its event's count: where the start it ends was never
// written (its answer lost before it was sent), it takes another
// attempt's, and a crash is counted one attempt later, never earlier.
func (m *Idempotent) payOwedEnds(ctx context.Context) {
	for {
		k, ok := m.unrecorded.take(crashKey{}, false)
		if !ok {
			return
		}
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		err := m.cfg.Store.EndAttempt(c, m.cfg.CrashQuerier, k.consumer, k.id)
		cancel()
		if err != nil {
			m.unrecorded.add(k)
			return
		}
	}
}

// endAttempt writes the end of an attempt of (consumer, id); when the
// database is away, it is owed (unrecorded) and written before the
// process's next attempt of any event (payOwedEnds): the process did not
// die in that attempt.
func (m *Idempotent) endAttempt(ctx context.Context, consumer string, id uuid.UUID) {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	if err := m.cfg.Store.EndAttempt(c, m.cfg.CrashQuerier, consumer, id); err != nil {
		m.unrecorded.add(crashKey{consumer, id})
	}
}

// endedByHandler reports, for an attempt whose handler failed, before its
// rollback, whether a statement of the handler ended the attempt's
// transaction: the claim was committed with the effects before it, or the
// statements after a ROLLBACK were autocommitted, and a retry would skip
// or repeat them. The commit path checks the same with the guard or the
// savepoint's release.
//   - pgx: the connection, still open, is idle outside a transaction
//     (COMMIT or ROLLBACK); or, after a statement that may end one
//     (txscan.go), the guard statement on the attempt's connection finds
//     the claim not the current transaction's (an aborted transaction,
//     25P02, or a dead connection is not that).
//   - PostgreSQL through database/sql: the guard statement, on the
//     attempt's connection, finds the claim not the current
//     transaction's (an aborted transaction, 25P02, or a broken
//     connection is not that).
//   - watermill-sql's subscriber transaction (NewSQLSubscriberBeginner):
//     the attempt's running row is gone on a transaction that answers.
//   - SQLite: the claim's savepoint is gone, unless the handler's error is
//     one SQLite may roll the transaction back for (BUSY, NOMEM,
//     INTERRUPT, IOERR, FULL; a context's end interrupts the statement).
//   - MySQL: the claim's savepoint is gone on a connection that answers,
//     the handler's error is not transient (a deadlock or a lock wait
//     timeout, with mysqlerr.Classify, rolls the transaction back), and
//     the claim is visible outside the attempt: an implicit commit (DDL)
//     or a COMMIT. A ROLLBACK by SQL followed by an error is not seen.
func (m *Idempotent) endedByHandler(ctx context.Context, tx attemptTx, herr error, consumer string, id uuid.UUID) bool {
	if ctx.Err() != nil {
		return false
	}
	switch t := tx.(type) {
	case *savepointTx:
		return t.endedByHandler(ctx)
	case *pgxTx:
		if t.savepoint != "" || t.closed || t.pc.IsClosed() {
			return false
		}
		if t.pc.PgConn().TxStatus() == 'I' {
			return true
		}
		if (!t.scan.mayEnd && !t.session.raw) || t.guard.sql == "" {
			return false
		}
		// On the attempt's own connection: a committed claim seen from
		// outside proves nothing once a killed backend released its
		// lock to another worker.
		var one int64
		err := t.pc.QueryRow(ctx, t.guard.sql, t.guard.args()...).Scan(&one)
		return err != nil && guardFailed(err)
	case *stdTx:
		switch {
		case t.guard.sql != "":
			err := t.runGuard(ctx)
			return err != nil && guardFailed(err)
		case !t.savepoint:
			return false
		case m.cfg.Store.Dialect() == sqldb.SQLite:
			if errors.Is(herr, context.DeadlineExceeded) || errors.Is(herr, context.Canceled) {
				return false
			}
			var c interface{ Code() int }
			if errors.As(herr, &c) {
				switch c.Code() & 0xff {
				case 5, 7, 9, 10, 13: // SQLITE_BUSY, NOMEM, INTERRUPT, IOERR, FULL
					return false
				}
			}
			return errors.Is(releaseClaimSavepoint(ctx, t.tx), errHandlerEndedBySQL)
		default: // MySQL
			if IsTransient(classify(herr, m.cfg.Classifier)) {
				return false
			}
			return errors.Is(releaseClaimSavepoint(ctx, t.tx), errHandlerEndedBySQL) && m.claimVisible(ctx, consumer, id)
		}
	}
	return false
}

// claimVisible reports whether (consumer, id)'s claim is committed: read
// outside the attempt.
func (m *Idempotent) claimVisible(ctx context.Context, consumer string, id uuid.UUID) bool {
	if m.outside == nil {
		return false
	}
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	done, err := m.cfg.Store.Processed(c, m.outside, consumer, id)
	return err == nil && done
}

// forgetAttempts deletes the count of (consumer, id) once the event was
// processed, or the message dead-lettered: a redrive of it starts afresh.
// When the database is away the count stays (a redrive then starts with
// it).
func (m *Idempotent) forgetAttempts(ctx context.Context, consumer string, id uuid.UUID) {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = m.cfg.Store.ForgetAttempts(c, m.cfg.CrashQuerier, consumer, id)
}

// attempt runs one claimed attempt: begin+claim, the handler, the produced
// messages, commit. Every path after the claim ends in the single deferred
// cleanup, which rolls back whatever did not commit and releases the
// connection, so a panic anywhere (handler, outbox write, schema adapter,
// commit) leaves no transaction, no lock and no acquired connection behind.
//
// endCount, when not nil, asks the attempt to end its crash count in its
// own transaction, just before the commit; it is set when that commit
// succeeded (the count's end committed with the claim). Otherwise the
// caller ends the count. fresh is set once the claim inserted (an event
// not processed yet).
func (m *Idempotent) attempt(h message.HandlerFunc, msg *message.Message, origCtx context.Context,
	consumer, handlerName string, eventID uuid.UUID, start time.Time, fields watermill.LogFields, endCount, fresh *bool) (_ []*message.Message, err error) {
	// A statement on the UUIDv7 claim table that found it gone (the commit
	// guard, a duplicate's read; the claim below: MigrateToPartitioned
	// folded it) turns it off: this attempt fails, the next claims in the
	// table.
	defer func() {
		if err != nil {
			m.cfg.Store.FoldedV7(eventID, err)
		}
	}()
	eventAt, _ := eventTime(msg, eventID) // occurred_at for ids without a time
	// Begin and claim: errors here come from the attempt's own connection.
	req := claimRequest{
		store:       m.cfg.Store,
		consumer:    consumer,
		eventID:     eventID,
		eventAt:     eventAt,
		lockTimeout: m.lockTimeout,
	}
	req.identity, req.verify = m.identityOf(msg)
	tx, claimed, err := m.cfg.Beginner.beginClaim(origCtx, req)
	claimDur := time.Since(start)
	if err != nil {
		if m.cfg.Store.FoldedV7(eventID, err) {
			err = &InfrastructureError{Op: "the UUIDv7 claim table is gone (MigrateToPartitioned): the next attempt claims in the table", Err: err}
		}
		err = fmt.Errorf("idempotency: begin and claim %s/%s: %w", consumer, eventID, claimError(err, m.cfg.Classifier))
		return nil, m.finish(handlerName, OutcomeFailed, start, claimDur, fields, err)
	}

	// ended is set once the transaction was committed or rolled back on a
	// path that returns; any other exit (a panic, runtime.Goexit) rolls back
	// here.
	ended := false
	defer func() {
		msg.SetContext(origCtx)
		if ended {
			tx.release()
			return
		}
		r := recover()
		_ = rollback(origCtx, tx)
		tx.release()
		if r == nil { // runtime.Goexit (t.FailNow in a handler): nothing to re-raise
			return
		}
		_ = m.finish(handlerName, OutcomeFailed, start, claimDur, fields, fmt.Errorf("idempotency: panic: %v", r))
		panic(r)
	}()

	if !claimed {
		err := m.unclaimed(origCtx, tx, req, handlerName, start, claimDur, fields)
		ended = true
		return nil, err
	}

	*fresh = true
	crashpoint.Reached(crashpoint.AfterClaim)
	state := stateOf(tx) // zero
	state.consumer, state.outcome, state.outbox, state.tx = consumer, OutcomeProcessed, m.cfg.Outbox, tx
	state.db = m.outside
	state.q, state.ptx, state.stx = tx.parts()
	faults := faultsFrom(origCtx)
	if faults != nil {
		state.injectFaults(faults)
	}
	state.ctx = sqldb.TxContext{Context: origCtx, Tx: state} // the attempt's one context value
	msg.SetContext(&state.ctx)

	produced, err := h(handlerMessage(msg))
	if err == nil {
		// A refusal of PublisherFromContext fails the attempt even when
		// the handler ignored the error it returned.
		err = state.refused
	}
	if err == nil && faults != nil {
		err = faults.BeforeCommit()
	}
	if err == nil {
		produced, err = m.emit(origCtx, state, produced)
		if err != nil && txEnded(err) && origCtx.Err() == nil {
			err = handlerEndedTx(err) // the outbox write found the transaction ended
		}
	}
	if err != nil {
		if m.endedByHandler(origCtx, tx, err, consumer, eventID) {
			// Retried, the claim the handler committed would ack the
			// event as a duplicate without the rest of its effects (or
			// the statements after its ROLLBACK, autocommitted, would
			// be applied again).
			_ = rollback(origCtx, tx)
			ended = true
			return nil, m.finish(handlerName, OutcomeFailed, start, claimDur, fields, handlerEndedTx(fmt.Errorf("%w (the handler then failed: %w)", errHandlerEndedBySQL, err)))
		}
		err = attemptError(err, rollback(origCtx, tx), m.cfg.Classifier)
		if statementsLost(err) {
			resetStatements(origCtx, tx)
		}
		ended = true
		return nil, m.finish(handlerName, OutcomeFailed, start, claimDur, fields, err)
	}

	// The crash count's end, in the transaction (endCountInTx). Not inside
	// watermill-sql's subscriber transaction: its commit (a savepoint's
	// release) is not one, the subscriber's commit may still fail and take
	// the count's end with it, and the row's lock would be held for the
	// whole batch.
	countEnded := false
	if _, joined := tx.(*savepointTx); endCount != nil && !joined {
		// On the transaction itself, not the handler's view of it (a
		// fault-injecting wrapper counts and fails handler statements).
		// In QueryExecModeExec on pgx (sqldb.OwnModeIn): a counted
		// attempt only, and behind a transaction pooler a statement of
		// pgx's cache failed here and aborted the attempt.
		q, ptx, _ := tx.parts()
		if q == nil {
			q = sqldb.PgxIn(ptx, sqldb.OwnModeIn(ownConn(ptx)))
		}
		countEnded = m.endCountInTx(origCtx, q, consumer, eventID)
	}
	crashpoint.Reached(crashpoint.BeforeCommit)
	// Commit: errors here come from the attempt's own connection, except
	// ErrTxAborted (a handler statement failed and the handler went on).
	if cErr := tx.commit(origCtx); cErr != nil {
		_ = rollback(origCtx, tx)
		ended = true
		return nil, m.finish(handlerName, OutcomeFailed, start, claimDur, fields, commitError(consumer, eventID, cErr, m.cfg.Classifier, origCtx.Err() != nil))
	}
	ended = true
	if countEnded {
		*endCount = true
	}
	crashpoint.Reached(crashpoint.AfterCommit)
	_ = m.finish(handlerName, state.outcome, start, claimDur, fields, nil)
	return produced, nil
}

// endCountInTx ends the crash count of a counted attempt in its
// transaction q, just before COMMIT, so that the end commits with the
// attempt, and reports whether it did. The count's statement runs under a
// savepoint: when it fails on its own (a lock held on the count's row past
// the lock timeout, 55P03; a handler's SET LOCAL ROLE without DELETE on
// <table>_crash, 42501; its SET LOCAL statement_timeout, 57014; its SET
// TRANSACTION READ ONLY, 25006; a lost prepared statement, 26000) the
// savepoint is rolled back, the attempt commits, and the caller ends the
// count after the commit, on its own connection (endAttempt). A
// transaction a handler statement already aborted (25P02) fails at the
// savepoint, and COMMIT reports that abort (ErrTxAborted) as before.
func (m *Idempotent) endCountInTx(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) bool {
	if _, err := q.Exec(ctx, "SAVEPOINT idempotency_count_end"); err != nil {
		return false
	}
	if err := m.cfg.Store.ForgetAttempts(ctx, q, consumer, eventID); err != nil {
		_, _ = q.Exec(ctx, "ROLLBACK TO SAVEPOINT idempotency_count_end")
		return false
	}
	_, err := q.Exec(ctx, "RELEASE SAVEPOINT idempotency_count_end")
	return err == nil
}

// unclaimed ends an attempt whose claim inserted nothing: a duplicate
// (acked: nil) or an event refused by the replay window, or a conflict
// (permanent). The transaction is ended on every path. A function of its
// own, off the new event's path (see holdPoison.hold).
func (m *Idempotent) unclaimed(origCtx context.Context, tx attemptTx, req claimRequest, handlerName string,
	start time.Time, claimDur time.Duration, fields watermill.LogFields) error {
	consumer, eventID, eventAt := req.consumer, req.eventID, req.eventAt
	if d, ok := tx.(duplicateEnder); ok {
		// pgx: the stored identity is read in one round trip with
		// the ROLLBACK (duplicate.go).
		o, reason, dErr := m.endDuplicate(origCtx, d, req, fields)
		switch {
		case dErr != nil && reason == "":
			return m.finish(handlerName, OutcomeFailed, start, claimDur, fields, claimError(dErr, m.cfg.Classifier))
		case dErr != nil:
			return m.finish(handlerName, o, start, claimDur, fields, permanent(reason, dErr))
		}
		_ = m.finish(handlerName, OutcomeDuplicate, start, claimDur, fields, nil)
		return nil
	}
	// Refused by the replay window (expired or future), or a duplicate.
	if o, reason, rerr := m.refused(origCtx, tx, consumer, eventID, eventAt, fields); rerr != nil {
		_ = rollback(origCtx, tx)
		if reason == "" { // the verdict itself failed: the attempt's connection
			return m.finish(handlerName, OutcomeFailed, start, claimDur, fields, claimError(rerr, m.cfg.Classifier))
		}
		return m.finish(handlerName, o, start, claimDur, fields, permanent(reason, rerr))
	}
	// A duplicate: with payload verification, the stored fingerprint
	// must be this message's (identity.go).
	if conflict, vErr := m.verifyDuplicate(origCtx, tx, req, fields); vErr != nil {
		_ = rollback(origCtx, tx)
		if conflict {
			return m.finish(handlerName, OutcomeConflict, start, claimDur, fields, permanent("event_id_reused", vErr))
		}
		return m.finish(handlerName, OutcomeFailed, start, claimDur, fields, claimError(vErr, m.cfg.Classifier))
	}
	// Nothing was written: end the transaction and ack.
	if rbErr := rollback(origCtx, tx); rbErr != nil {
		m.logger.Debug("Rollback after duplicate failed", fields.Add(watermill.LogFields{"error": oneLine(rbErr.Error())}))
	}
	_ = m.finish(handlerName, OutcomeDuplicate, start, claimDur, fields, nil)
	return nil
}

// rollback ends tx on a context that survives the message context's
// cancellation (a shutdown must still roll back), bounded by rollbackTimeout.
func rollback(ctx context.Context, tx attemptTx) error {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	return tx.rollback(c)
}

// emit checks every message the attempt produced (returned and published
// through PublisherFromContext) and, with an outbox, writes them to it in the
// attempt's transaction. It returns the messages for the router: none with
// an outbox. Returned messages bound for the outbox are checked once, by the
// outbox's Publish (outbox.ErrNotEnvelope, mapped by writeOutbox); those
// published through PublisherFromContext were checked when published.
func (m *Idempotent) emit(ctx context.Context, st *attemptState, returned []*message.Message) ([]*message.Message, error) {
	if m.cfg.Outbox == nil {
		for _, p := range returned {
			if err := checkProduced(p); err != nil {
				return nil, err
			}
		}
		return returned, nil
	}
	for _, b := range st.buffered {
		if err := m.writeOutbox(ctx, st, b.topic, b.msgs); err != nil {
			return nil, err
		}
	}
	if len(returned) > 0 {
		topic := m.cfg.OutboxTopic
		if topic == "" {
			topic = message.PublishTopicFromCtx(ctx)
		}
		if topic == "" {
			return nil, permanent("no_outbox_topic", errors.New("idempotency: the handler returned messages but neither Config.OutboxTopic nor the handler's publish topic names their destination"))
		}
		if err := m.writeOutbox(ctx, st, topic, returned); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

func (m *Idempotent) writeOutbox(_ context.Context, st *attemptState, topic string, msgs []*message.Message) error {
	pub, err := st.publisher()
	if err != nil {
		return err
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		if errors.Is(err, outbox.ErrNotEnvelope) {
			return permanent("invalid_produced", fmt.Errorf("%w: %w", ErrInvalidProduced, err))
		}
		return fmt.Errorf("idempotency: write produced messages to the outbox: %w", err)
	}
	return nil
}

// MetadataAttempt is the metadata key in which the middleware counts its
// attempts at a message ("1", "2", …): the chain's retry re-runs the middleware
// with the same message, and the count travels with it to the poison topic.
const MetadataAttempt = "idempotency_attempt"

func nextAttempt(msg *message.Message) int {
	n := 0
	if s := msg.Metadata.Get(MetadataAttempt); s != "" {
		n, _ = strconv.Atoi(s)
	}
	n++
	msg.Metadata.Set(MetadataAttempt, strconv.Itoa(n))
	return n
}

// eventTime is the message's production time: the UUIDv7 timestamp, else
// occurred_at.
func eventTime(msg *message.Message, id uuid.UUID) (time.Time, bool) {
	if id.Version() == 7 {
		sec, nsec := id.Time().UnixTime()
		return time.Unix(sec, nsec), true
	}
	if at, err := marshaler.OccurredAt(msg); err == nil && !at.IsZero() {
		return at, true
	}
	return time.Time{}, false
}

// finish records the attempt's outcome and logs it, and returns err as the
// attempt returns it (on one line: see singleLine), so that the log and the
// error the router, Retry and PoisonQueue see carry the same text. A
// processed event is logged at trace, a skipped one (duplicate, stale,
// obsolete) at debug. Any other outcome is logged with the logger's Error
// (Watermill's LoggerAdapter has no warn level; the adapter puts err in its
// error field, "error" for watermill.NewSlogLogger) unless it is transient:
// rejections and handler errors (bound for the poison topic) and any other
// failure someone must look at. A transient failure (the message stays on
// the broker and is retried) is logged at info with the field "error".
func (m *Idempotent) finish(handlerName string, o Outcome, start time.Time, claim time.Duration, fields watermill.LogFields, err error) error {
	switch o {
	case OutcomeProcessed, OutcomeStale, OutcomeObsolete:
		m.noteClaim(false)
	case OutcomeDuplicate, OutcomeConflict:
		m.noteClaim(true)
	}
	total := time.Since(start)
	m.cfg.Recorder.RecordOutcome(Observation{Consumer: m.cfg.Consumer, HandlerName: handlerName, Outcome: o, Claim: claim, Total: total})
	if m.quiet {
		if o == OutcomeProcessed || o == OutcomeDuplicate || o == OutcomeStale || o == OutcomeObsolete {
			return nil
		}
		return singleLine(err)
	}
	return m.log(o, total, fields, err)
}

// log is finish's logging, a function of its own so that the attempt's
// stack stays small on the quiet path (see holdPoison.hold).
func (m *Idempotent) log(o Outcome, total time.Duration, fields watermill.LogFields, err error) error {
	f := fields.Add(watermill.LogFields{"outcome": string(o), "duration": total})
	switch o {
	case OutcomeProcessed:
		m.logger.Trace("Event processed", f)
		return nil
	case OutcomeDuplicate, OutcomeStale, OutcomeObsolete:
		m.logger.Debug("Event skipped", f)
		return nil
	}
	err = singleLine(err)
	var p *PermanentError
	if errors.As(err, &p) {
		f = f.Add(watermill.LogFields{"reason": p.Reason})
	}
	if !IsTransient(err) {
		m.logger.Error("Event not processed", err, f)
	} else {
		m.logger.Info("Event not processed, will be retried", f.Add(watermill.LogFields{"error": err}))
	}
	return err
}

// handlerMessage is the delivery msg as the handler sees it: the same id,
// payload, metadata (the same map) and context, but its own Ack and Nack,
// which reach nobody. The chain acks the delivery after the commit, or
// gives it back; a handler's msg.Ack() (a plain subscriber loop's idiom)
// acked it before the commit, and when the attempt then failed the event
// was lost: the broker had it acked, the subscriber ended the message's
// context, and the chain's retry and dead-lettering never ran.
func handlerMessage(msg *message.Message) *message.Message {
	// NewMessage, with its ack channels: a Message built without them
	// returns nil from Acked and Nacked until acked, a channel a handler
	// that took it first (to wait for a worker's ack) waits on forever.
	// The metadata map is the delivery's own.
	hm := message.NewMessage(msg.UUID, msg.Payload)
	hm.Metadata = msg.Metadata
	hm.SetContext(msg.Context())
	return hm
}
