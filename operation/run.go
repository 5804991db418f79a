package operation

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/sqlitefile"
)

// Defaults of Config.
const (
	// DefaultTable is the operations table used when Config.Table is empty.
	DefaultTable = "operation"
	// DefaultWait bounds how long Do waits for another live worker that
	// holds the same key (Config.Wait).
	DefaultWait = 5 * time.Second
	// DefaultWriteTimeout bounds each write of a call's outcome
	// (Config.WriteTimeout).
	DefaultWriteTimeout = 10 * time.Second
)

// Crash points of this package (internal/crashpoint), for kill tests.
const (
	// crashAfterBegin: the started record is committed and the key's lock is
	// held; the provider has not been called.
	crashAfterBegin = "operation-after-begin"
	// crashAfterCall: the provider answered (accepted, rejected or timed
	// out); the outcome is not recorded.
	crashAfterCall = "operation-after-call"
)

// Config configures a Runner (NewRunner).
type Config struct {
	// DB is where the Runner takes its connections (idempotency.Pgx or
	// idempotency.SQL). Required. One connection per Do, held from the
	// begin transaction until the outcome is recorded, including during the
	// external call (on PostgreSQL and MySQL it carries the key's session
	// lock). It must not be the connection of the caller's transaction, and
	// it must be a direct connection or a session-mode pooler: a
	// transaction-mode pooler (PgBouncer pool_mode=transaction, ProxySQL
	// multiplexing) breaks session locks; once an unlock shows it (the
	// session that answers does not hold the lock it took), Do refuses with
	// a configuration error that says so. Size it for the handlers that run
	// at once, on top of the connections their own transactions use, or
	// give the Runner a pool of its own: Do waits at most 10 s for a
	// connection, then fails (transient) naming the pool and how many of
	// its connections are in use. On SQLite it must be a database file of
	// its own, not the consumer's: SQLite has one writer per file, and the
	// Runner commits its started record while the handler's transaction
	// holds that file's write lock (NewRunner and middleware.NewConsumer
	// refuse the shared file, ErrSharedSQLiteFile).
	DB idempotency.DB

	// Table is the operations table, "name" or "schema.name"; each part must
	// match [A-Za-z_][A-Za-z0-9_]{0,62}. Validated and quoted once, in
	// NewRunner. Defaults to DefaultTable.
	Table string

	// Wait bounds how long Do waits for the key when another live worker
	// holds it (PostgreSQL: lock_timeout on the lock wait; MySQL: GET_LOCK's
	// timeout; SQLite: a timer). When it expires Do returns an
	// InProgressError (transient). Defaults to DefaultWait; a negative value
	// means do not wait (an InProgressError at once). Whole milliseconds (a
	// positive value below 1ms counts as 1ms); on MySQL whole seconds,
	// rounded up.
	Wait time.Duration

	// WriteTimeout bounds each write of a call's outcome. The writes run on
	// a context detached from Do's ctx, so a cancelled handler context never
	// loses an outcome the provider already produced. Defaults to
	// DefaultWriteTimeout.
	WriteTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.Wait == 0 {
		c.Wait = DefaultWait
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
}

// Validate reports the first invalid field of c, naming it.
func (c Config) Validate() error {
	h, err := sqldb.HandleOf(c.DB)
	if err != nil {
		return fmt.Errorf("operation: Config.DB: %w", err)
	}
	if err := h.Dialect.Validate(); err != nil {
		return fmt.Errorf("operation: Config.DB: %w", err)
	}
	if c.Table != "" {
		if _, err := sqldb.ParseIdent(c.Table); err != nil {
			return fmt.Errorf("operation: Config.Table: %w", err)
		}
	}
	if c.WriteTimeout < 0 {
		return fmt.Errorf("operation: Config.WriteTimeout %s: must be ≥ 0", c.WriteTimeout)
	}
	return nil
}

// Runner runs external operations effectively once per key (see Do). It is
// safe for concurrent use; it holds no goroutine and needs no Close.
type Runner struct {
	db           *sqldb.Handle
	pool         connPool
	dialect      sqldb.Dialect
	table        sqldb.Ident
	wait         time.Duration
	writeTimeout time.Duration
	logger       watermill.LoggerAdapter
	sql          dialectSQL
	file         atomic.Pointer[string] // SQLite: the runner's database file, once read
	// pooled: an unlock found the key's session lock not held by the
	// session that took it: the connection's server session changes under
	// it (a transaction pooler). Do refuses from then on (errPooled).
	pooled atomic.Bool
}

// errSessionPooler: the Runner's connections do not keep their session.
var errSessionPooler = errors.New("operation: the Runner's connections do not keep their database session " +
	"(the key's session lock was not held by the session that took it): a transaction pooler (PgBouncer pool_mode=transaction, " +
	"ProxySQL multiplexing) sits between the Runner and the database; the key's lock is a session lock held through the external call, " +
	"so give Config.Pool/Config.DB a direct connection or a session-pooling one")

// configError is a deployment error: held, never poisoned, logged with what
// to fix (middleware.ClassOf: Configuration).
type configError struct{ err error }

func (e *configError) Error() string       { return e.err.Error() }
func (e *configError) Unwrap() error       { return e.err }
func (e *configError) Configuration() bool { return true }

// NewRunner validates cfg (on a copy with defaults applied) and builds the
// SQL text once. A nil logger is watermill.NopLogger. It does not write to
// the database: run Migrate (or apply MigrationsFS) first. On SQLite it reads
// Config.DB's database file (one query, bounded by 10 s) and refuses, with an
// error wrapping ErrSharedSQLiteFile that names Config.DB and the file, the
// file of an idempotent middleware built in this process (see Config.DB).
func NewRunner(cfg Config, logger watermill.LoggerAdapter) (*Runner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	h, _ := sqldb.HandleOf(cfg.DB)
	var file *string
	if h.Dialect == sqldb.SQLite {
		path, err := sqlitefile.Register(h.Std, sqlitefile.Operations)
		if err != nil {
			if errors.Is(err, ErrSharedSQLiteFile) {
				return nil, fmt.Errorf("operation.Config.DB: the SQLite file %s is the database of an idempotent middleware "+
					"(middleware.NewConsumer) in this process, whose transactions hold its write lock while handlers call Do: "+
					"open operation.Config.DB on a database file of its own (for example %s next to it, with busy_timeout and WAL) "+
					"and run Runner.Migrate there: %w", path, ownFileHint(path), err)
			}
			return nil, fmt.Errorf("operation: Config.DB: %w", err)
		}
		file = &path
	}
	table, _ := sqldb.ParseIdent(cfg.Table)
	var pool connPool
	if h.Pgx != nil {
		pool = newPgxConnPool(h.Pgx)
	} else {
		pool = newStdConnPool(h.Std)
	}
	r := &Runner{
		db:           h,
		pool:         pool,
		dialect:      h.Dialect,
		table:        table,
		wait:         cfg.Wait,
		writeTimeout: cfg.WriteTimeout,
		logger:       logger,
		sql:          sqlFor(h.Dialect).render(table.Quoted(h.Dialect.QuoteChar())),
	}
	if file != nil {
		r.file.Store(file)
	}
	return r, nil
}

// ownFileHint is a file name next to path for the runner's records.
func ownFileHint(path string) string {
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "-operations" + ext
}

// checkOwnFile refuses, on SQLite, a Do inside a caller's transaction on the
// runner's own database file (see Config.DB). The runner's file is read once.
func (r *Runner) checkOwnFile(ctx context.Context, key Key) error {
	q, ok := sqldb.TxFromContext(ctx)
	if !ok {
		return nil
	}
	mine := r.file.Load()
	if mine == nil {
		var f string
		if err := r.pool.QueryRow(ctx, sqliteMainFile).Scan(&f); err != nil {
			return fmt.Errorf("operation %s: read the runner's database file: %w", key, err)
		}
		mine = &f
		r.file.Store(mine)
	}
	if *mine == "" { // an in-memory or temporary database: its own
		return nil
	}
	var theirs string
	if err := q.QueryRow(ctx, sqliteMainFile).Scan(&theirs); err != nil {
		return fmt.Errorf("operation %s: read the database file of the caller's transaction: %w", key, err)
	}
	if theirs != *mine {
		return nil
	}
	return &invalidError{fmt.Errorf("operation %s: %w %s: open operation.Config.DB on a database file of its own "+
		"(for example next to it, with its own busy_timeout and WAL) and run Runner.Migrate there", key, ErrSharedSQLiteFile, *mine)}
}

// sqliteMainFile is the path of the connection's main database file ("" for
// an in-memory or temporary one).
const sqliteMainFile = sqlitefile.MainFileQuery

// Table is the operations table's name, as validated ("name" or "schema.name").
func (r *Runner) Table() string { return r.table.String() }

// dialectOf is the runner's SQL dialect.
func (r *Runner) dialectOf() sqldb.Dialect { return r.dialect }

// Option adjusts one Do call.
type Option func(*options)

type options struct {
	reconcile ReconcileFunc
	wait      time.Duration
}

// WithReconcile gives Do the function that looks an uncertain operation up at
// the provider. Without it, an uncertain operation is never settled by Do: it
// returns a permanent UncertainError for the reconciliation topic. With it,
// an uncertain outcome (a timeout now, or a crash during an earlier attempt)
// makes Do return a transient UncertainError, and the next attempt calls f
// before anything else.
func WithReconcile(f ReconcileFunc) Option { return func(o *options) { o.reconcile = f } }

// WithWait overrides Config.Wait for one call; d ≤ 0 means do not wait (an
// InProgressError at once when another live worker holds the key).
func WithWait(d time.Duration) Option { return func(o *options) { o.wait = d } }

// Do runs the operation named key at most once in effect, whatever the number
// of attempts, deliveries and workers, and returns its Result. params are
// the request's defining parameters (see Fingerprint); call performs it.
//
// The protocol, each step on a connection of Config.Pool (or Config.DB),
// never on the caller's transaction:
//
//  1. Begin: take the key's lock (a session lock on PostgreSQL and MySQL, a
//     lock of the process on SQLite; held until Do returns), then, in a
//     short transaction of its own, committed before call runs, insert the
//     record as started, or read the existing one. If another live worker
//     holds the lock: a record with another fingerprint is a ConflictError
//     at once; otherwise wait up to Config.Wait, then an InProgressError
//     (transient).
//  2. An existing record is first compared by fingerprint, whatever its
//     state: another fingerprint is a ConflictError (permanent), returned
//     before any call, and the record is left as it is. Then, by state:
//     succeeded → its Result (Origin OriginStored), nothing called;
//     failed → a FailedError (permanent), nothing called;
//     started with no owner (the last call certainly did nothing) → call;
//     started with an owner whose lease is live (the owner renews the
//     record during its call, every 5 s of a 15 s lease) → the owner is
//     alive though its session lock is gone (idle_session_timeout, a
//     terminated backend): an InProgressError (transient), never a call;
//     started with an owner whose lease ran out, or uncertain → the owner
//     died during a call: the outcome is uncertain. With
//     WithReconcile, the reconcile function decides (found → success
//     recorded, OriginReconciled; ErrNotFound → call, same key; Rejected →
//     failed; Transient → a transient UncertainError). Without it, the record
//     is marked uncertain and Do returns a permanent UncertainError. Never a
//     blind call.
//  3. Right before the call, renew the record if it is still this
//     attempt's (a worker paused past its lease finds another owner and
//     does not call; a pause between that write and the call itself is the
//     window left, which the key passed to the provider closes where the
//     provider deduplicates by it); renew it during the call.
//     Call, then record the outcome in a second write, only if this attempt
//     still owns the record: success → succeeded with Reference and Data;
//     Rejected → failed, FailedError; Transient → started with no owner, a
//     transient error (the retry calls again, same key); Timeout or any
//     other error → uncertain, an UncertainError (transient with
//     WithReconcile, permanent without).
//
// A record is never deleted. Errors from the database are returned wrapped
// (%w), for the middleware to classify (connection loss, 55P03, MySQL 1205,
// SQLITE_BUSY, … are transient). A zero key, a nil call or parameters
// Canonical refuses give a permanent error wrapping ErrInvalidKey or
// ErrInvalidParams.
//
// If call panics, the panic propagates after the lock is released; the
// record stays started with this attempt as owner, so the next attempt,
// once the attempt's lease ran out (15 s), treats the outcome as uncertain.
func (r *Runner) Do(ctx context.Context, key Key, params any, call CallFunc, opts ...Option) (Result, error) {
	if key.IsZero() {
		return Result{}, &invalidError{fmt.Errorf("%w: zero Key", ErrInvalidKey)}
	}
	if call == nil {
		return Result{}, &invalidError{fmt.Errorf("operation %s: nil CallFunc", key)}
	}
	fp, err := Fingerprint(params)
	if err != nil {
		return Result{}, &invalidError{fmt.Errorf("operation %s: %w", key, err)}
	}
	o := options{wait: r.wait}
	for _, opt := range opts {
		opt(&o)
	}
	if r.dialect == sqldb.SQLite {
		if err := r.checkOwnFile(ctx, key); err != nil {
			return Result{}, err
		}
	}
	if r.pooled.Load() {
		return Result{}, &configError{fmt.Errorf("operation %s: %w", key, errSessionPooler)}
	}
	a, err := r.acquire(ctx, key, o)
	if err != nil {
		return Result{}, ownDBError(err)
	}
	defer a.release()
	a.fp, a.params = fp, params

	d, rec, err := a.begin(ctx)
	if err != nil {
		return Result{}, ownDBError(err)
	}
	switch d {
	case decideStored:
		return Result{Reference: rec.Reference, Data: rec.Result, Origin: OriginStored}, nil
	case decideFailed:
		return Result{}, &FailedError{Key: key.String(), Reason: rec.Error}
	case decideUncertain:
		return Result{}, &UncertainError{Key: key.String(), Kind: key.Kind(), Reference: rec.Reference, Attempts: rec.Attempts}
	case decideReconcile:
		return a.reconcile(ctx, rec, call)
	default:
		return a.call(ctx, rec, call)
	}
}

// Get returns the record of key, or an error wrapping ErrNoRecord. It reads
// without the key's lock: a started record may be in flight or dead.
func (r *Runner) Get(ctx context.Context, key Key) (Record, error) {
	if key.IsZero() {
		return Record{}, fmt.Errorf("%w: zero Key", ErrInvalidKey)
	}
	return r.get(ctx, r.pool, key)
}

func (r *Runner) get(ctx context.Context, q sqldb.Querier, key Key) (Record, error) {
	var s recordScan
	if err := q.QueryRow(ctx, r.sql.get.sql, r.sql.get.args(key.String())...).Scan(s.dest()...); err != nil {
		if errors.Is(err, sqldb.ErrNoRows) {
			return Record{}, fmt.Errorf("operation %s: %w", key, ErrNoRecord)
		}
		return Record{}, fmt.Errorf("operation %s: get: %w", key, err)
	}
	return s.record(), nil
}

// Verdict is what a person or a reconciliation process found out about an
// uncertain operation, for Resolve. Build one with VerdictSucceeded,
// VerdictFailed or VerdictNotExecuted.
type Verdict struct {
	state  State
	result Result
	reason string
}

// VerdictSucceeded: the provider did it; res is recorded as the result (its
// Origin is ignored), and later Do calls return it (OriginStored).
func VerdictSucceeded(res Result) Verdict { return Verdict{state: StateSucceeded, result: res} }

// VerdictFailed: the provider refused it; later Do calls return a
// FailedError with reason.
func VerdictFailed(reason string) Verdict { return Verdict{state: StateFailed, reason: reason} }

// VerdictNotExecuted: the provider has no trace of it; the record goes back
// to started with no owner, and the next Do calls the provider (same key).
// reason is recorded as the error text.
func VerdictNotExecuted(reason string) Verdict {
	return Verdict{state: StateStarted, reason: reason}
}

// Resolve records the verdict on a started or uncertain record: the manual
// (or scripted) end of the reconciliation topic. It takes the key's lock
// first, waiting as Do does (InProgressError when a live worker keeps it, or
// when the owner's session is gone but its lease is live), so it never moves
// a record under a live owner; the resolver becomes the
// owner. A record already succeeded or failed is refused (ErrFinal), a
// missing one too (ErrNoRecord). Resolve does not compare fingerprints: it
// takes no parameters.
func (r *Runner) Resolve(ctx context.Context, key Key, v Verdict) error {
	if key.IsZero() {
		return fmt.Errorf("%w: zero Key", ErrInvalidKey)
	}
	if v.state == "" {
		return errors.New("operation: Resolve: zero Verdict (use VerdictSucceeded, VerdictFailed or VerdictNotExecuted)")
	}
	a, err := r.acquire(ctx, key, options{wait: r.wait})
	if err != nil {
		return err
	}
	defer a.release()
	if err := a.lock(ctx, false); err != nil {
		return err
	}
	tx, err := a.conn.begin(ctx)
	if err != nil {
		return fmt.Errorf("operation %s: resolve: begin: %w", key, err)
	}
	defer a.rollback(tx)
	rec, err := r.get(ctx, tx, key)
	if err != nil {
		return err
	}
	if rec.State == StateSucceeded || rec.State == StateFailed {
		return fmt.Errorf("operation %s: resolve: state %s: %w", key, rec.State, ErrFinal)
	}
	if rec.State == StateStarted && rec.Owner != "" {
		// The lock is ours, so the owner's session is gone, but an owner
		// whose lease is live is still calling (see decide): moving its
		// record would let the next Do call again under its running call.
		if live, err := a.leaseLive(ctx, tx); err != nil {
			return err
		} else if live {
			return &InProgressError{Key: key.String(), Err: errLeaseLive}
		}
	}
	var owner, data any
	if v.state != StateStarted {
		owner = r.sql.owner(a.owner)
	}
	if v.state == StateSucceeded && v.result.Data != nil {
		data = v.result.Data
	}
	final := v.state == StateSucceeded || v.state == StateFailed
	if _, err := tx.Exec(ctx, r.sql.resolve.sql, r.sql.resolve.args(key.String(), string(v.state), owner,
		storableText(v.result.Reference), data, storableText(v.reason), final)...); err != nil {
		return fmt.Errorf("operation %s: resolve: %w", key, err)
	}
	if err := tx.commit(ctx); err != nil {
		return fmt.Errorf("operation %s: resolve: commit: %w", key, err)
	}
	r.logger.Info("Operation resolved", watermill.LogFields{"key": key.String(), "from": string(rec.State), "to": string(v.state)})
	return nil
}

type decision int

const (
	decideCall decision = iota
	decideStored
	decideFailed
	decideUncertain
	decideReconcile
)

// attempt is one Do (or Resolve) call: its connection, its owner token and
// whether it holds the key's lock.
type attempt struct {
	r      *Runner
	key    Key
	fp     string
	params any // compared with records of older fingerprint versions (sameRequest)
	opts   options
	owner  uuid.UUID
	lk     lockKey
	conn   conn
	locked bool
	// dirty: the session's lock state is unknown (a failed lock or unlock):
	// the connection is closed rather than returned, which releases every
	// lock the session held.
	dirty bool
	// write0: the attempt's connection failed a statement (its session may
	// be gone), so a lock it no longer holds says nothing of a pooler.
	write0 bool
	fields watermill.LogFields
}

func (r *Runner) acquire(ctx context.Context, key Key, o options) (*attempt, error) {
	actx, cancel := context.WithTimeout(ctx, acquireTimeout)
	defer cancel()
	conn, err := r.pool.acquire(actx)
	if err != nil {
		if ctx.Err() == nil && actx.Err() != nil {
			// Never wait forever, and say for what: a Runner on the
			// handlers' own pool, with as many handlers at once as
			// connections, waits for a connection only a handler can free.
			r.logger.Error("Operation runner has no connection", err, watermill.LogFields{"key": key.String(), "pool": r.pool.describe()})
			return nil, &transientError{fmt.Errorf("operation %s: no connection from the Runner's pool within %s (%s): "+
				"each Do holds one connection of Config.Pool/Config.DB through its call; a Runner sharing the handlers' pool, "+
				"with as many handlers at once as connections, waits for itself: give the Runner a pool of its own or more connections: %w",
				key, acquireTimeout, r.pool.describe(), err)}
		}
		return nil, fmt.Errorf("operation %s: acquire connection: %w", key, err)
	}
	owner := uuid.New()
	return &attempt{
		r: r, key: key, opts: o, conn: conn, owner: owner,
		lk:     lockKey{key: key.String(), table: r.table.String(), quoted: r.table.Quoted('"')},
		fields: watermill.LogFields{"key": key.String(), "owner": owner.String()},
	}, nil
}

// detached returns a context that outlives ctx's cancellation, bounded by
// the write timeout: outcome writes and unlocks must happen even when the
// handler's context ended.
func (a *attempt) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), a.r.writeTimeout)
}

func (a *attempt) rollback(t tx) {
	ctx, cancel := a.detached(context.Background())
	defer cancel()
	_ = t.rollback(ctx) // no-op after commit
}

// release unlocks the key and returns the connection; on any doubt about the
// session's locks it closes the connection instead, which releases them. A
// lock of the process (SQLite) is always released here.
func (a *attempt) release() {
	ctx, cancel := a.detached(context.Background())
	defer cancel()
	locker := a.r.sql.locker
	if a.locked && (!a.dirty || !locker.session()) {
		if ok, err := locker.unlock(ctx, a.conn, &a.lk); err != nil || !ok {
			a.r.logger.Info("Operation unlock failed; closing the connection", a.fields.Add(watermill.LogFields{"err": err, "held": ok}))
			a.dirty = true
			if err == nil && !a.write0 {
				// The session answered, and does not hold the lock it took,
				// though it never failed (a.write0: no outcome write had to
				// go elsewhere): another session answers on this connection.
				a.r.pooled.Store(true)
				a.r.logger.Error("Operation runner behind a transaction pooler: refusing further calls", errSessionPooler, a.fields)
			}
		}
	}
	a.conn.release(ctx, a.dirty)
}

// lock takes the key's lock on the attempt's connection, outside any
// transaction (so that the begin transaction, and its snapshot, start once
// the previous holder has committed and let go). If another worker holds
// it: with peek, a recorded fingerprint other than a.fp is a ConflictError
// at once; then wait up to opts.wait, or return an InProgressError.
func (a *attempt) lock(ctx context.Context, peek bool) error {
	locker := a.r.sql.locker
	got, err := locker.try(ctx, a.conn, &a.lk)
	if err != nil {
		a.dirty = true
		return fmt.Errorf("operation %s: lock: %w", a.key, err)
	}
	if got {
		a.locked = true
		return nil
	}
	if peek {
		var stored string
		err := a.conn.QueryRow(ctx, a.r.sql.peek.sql, a.r.sql.peek.args(a.key.String())...).Scan(&stored)
		switch {
		case err == nil && !sameRequest(stored, a.fp, a.params):
			return &ConflictError{Key: a.key.String(), Fingerprint: a.fp, StoredFingerprint: stored}
		case err != nil && !errors.Is(err, sqldb.ErrNoRows):
			return fmt.Errorf("operation %s: peek: %w", a.key, err)
		}
	}
	if a.opts.wait <= 0 {
		return &InProgressError{Key: a.key.String()}
	}
	timedOut, err := locker.wait(ctx, a.conn, &a.lk, a.opts.wait)
	switch {
	case err != nil:
		a.dirty = true // cancelled or broken: the lock may have been granted
		return fmt.Errorf("operation %s: wait for lock: %w", a.key, err)
	case timedOut != nil:
		return &InProgressError{Key: a.key.String(), Err: timedOut}
	}
	a.locked = true
	return nil
}

// begin is step 1 and 2 of Do: the key's lock, then one short transaction
// committed before any call.
func (a *attempt) begin(ctx context.Context) (decision, Record, error) {
	if err := a.lock(ctx, true); err != nil {
		return 0, Record{}, err
	}
	tx, err := a.conn.begin(ctx)
	if err != nil {
		return 0, Record{}, fmt.Errorf("operation %s: begin: %w", a.key, err)
	}
	defer a.rollback(tx)
	inserted, rec, err := a.claim(ctx, tx)
	if err != nil {
		return 0, Record{}, err
	}
	d, err := a.decide(ctx, tx, inserted, &rec)
	if err != nil {
		return 0, Record{}, err
	}
	if err := tx.commit(ctx); err != nil {
		return 0, Record{}, fmt.Errorf("operation %s: commit begin: %w", a.key, err)
	}
	return d, rec, nil
}

// claim inserts the started record or reads the existing one, in tx, under
// the key's lock, and reports whether this attempt inserted it.
func (a *attempt) claim(ctx context.Context, tx tx) (bool, Record, error) {
	q := a.r.sql.claim
	args := q.args(a.key.String(), a.r.sql.owner(a.owner), a.key.Kind(), a.fp)
	if a.r.sql.claimReturns {
		var (
			inserted bool
			s        recordScan
		)
		if err := tx.QueryRow(ctx, q.sql, args...).Scan(append([]any{&inserted}, s.dest()...)...); err != nil {
			return false, Record{}, fmt.Errorf("operation %s: claim: %w", a.key, err)
		}
		return inserted, s.record(), nil
	}
	if _, err := tx.Exec(ctx, q.sql, args...); err != nil {
		return false, Record{}, fmt.Errorf("operation %s: claim: %w", a.key, err)
	}
	rec, err := a.r.get(ctx, tx, a.key)
	if err != nil {
		return false, Record{}, fmt.Errorf("operation %s: claim: %w", a.key, err)
	}
	// The owner token is fresh: only this attempt's insert can have set it.
	return rec.Owner == a.owner.String(), rec, nil
}

// decide applies step 2 to the claimed or found record, under the lock,
// taking ownership in tx where the attempt goes on.
func (a *attempt) decide(ctx context.Context, tx tx, inserted bool, rec *Record) (decision, error) {
	if inserted {
		return decideCall, nil
	}
	// Every path that returns an existing record starts here.
	if !sameRequest(rec.Fingerprint, a.fp, a.params) {
		return 0, &ConflictError{Key: a.key.String(), Fingerprint: a.fp, StoredFingerprint: rec.Fingerprint, State: rec.State}
	}
	take := func(to State) error {
		var prev any
		if rec.Owner != "" {
			u, err := uuid.Parse(rec.Owner)
			if err != nil {
				return fmt.Errorf("operation %s: stored owner %q: %w", a.key, rec.Owner, err)
			}
			prev = a.r.sql.owner(u)
		}
		q := a.r.sql.take
		args := q.args(a.key.String(), a.r.sql.owner(a.owner), string(to), string(rec.State), prev)
		moved := &transientError{fmt.Errorf("operation %s: record moved while locked (edited outside the Runner?)", a.key)}
		attempts := int64(rec.Attempts + 1)
		if a.r.sql.returning {
			err := tx.QueryRow(ctx, q.sql, args...).Scan(&attempts)
			if errors.Is(err, sqldb.ErrNoRows) {
				return moved
			}
			if err != nil {
				return fmt.Errorf("operation %s: take: %w", a.key, err)
			}
		} else {
			// Under the key's lock the row is the one just read: its
			// attempts count goes up by one.
			n, err := tx.Exec(ctx, q.sql, args...)
			if err != nil {
				return fmt.Errorf("operation %s: take: %w", a.key, err)
			}
			if n != 1 {
				return moved
			}
		}
		rec.State, rec.Owner, rec.Attempts = to, a.owner.String(), int(attempts)
		return nil
	}
	switch rec.State {
	case StateSucceeded:
		return decideStored, nil
	case StateFailed:
		return decideFailed, nil
	case StateStarted:
		if rec.Owner == "" {
			return decideCall, take(StateStarted)
		}
		// We hold the lock, so the owner's session is gone. That alone
		// does not make the owner dead (idle_session_timeout, a
		// terminated backend, a pooler's server connection: the session
		// went, the process goes on): an owner renews its record's lease
		// during its call, so a live lease means a live call. Wait for it.
		if live, err := a.leaseLive(ctx, tx); err != nil {
			return 0, err
		} else if live {
			a.r.logger.Info("Operation owned by a live attempt whose session lock is gone: waiting",
				a.fields.Add(watermill.LogFields{"previous_owner": rec.Owner}))
			return 0, &InProgressError{Key: a.key.String(), Err: errLeaseLive}
		}
		// Its lease expired too: it died between its begin and its outcome
		// write. Its call may have run.
		a.r.logger.Info("Operation left started by a dead attempt: outcome uncertain",
			a.fields.Add(watermill.LogFields{"previous_owner": rec.Owner, "reconcile": a.opts.reconcile != nil}))
		if err := take(StateUncertain); err != nil {
			return 0, err
		}
		if a.opts.reconcile != nil {
			return decideReconcile, nil
		}
		return decideUncertain, nil
	case StateUncertain:
		if a.opts.reconcile == nil {
			return decideUncertain, nil // left as it is: nothing to own
		}
		return decideReconcile, take(StateUncertain)
	default:
		return 0, fmt.Errorf("operation %s: unknown state %q", a.key, rec.State)
	}
}

// write runs an owner-checked outcome statement, on the attempt's connection
// and, if that fails, once more on a fresh pool connection. want is the
// state the statement moves to, used to recognise a first write that
// committed but whose answer was lost.
func (a *attempt) write(ctx context.Context, want State, q stmt, args ...any) (bool, error) {
	args = q.args(args...)
	wctx, cancel := a.detached(ctx)
	defer cancel()
	n, err := a.conn.Exec(wctx, q.sql, args...)
	if err == nil {
		return n == 1, nil
	}
	a.r.logger.Info("Operation outcome write failed; retrying on another connection", a.fields.Add(watermill.LogFields{"err": err}))
	a.dirty = true
	a.write0 = true
	wctx2, cancel2 := a.detached(ctx)
	defer cancel2()
	n, err2 := a.poolExec(wctx2, q.sql, args...)
	if err2 != nil {
		return false, errors.Join(err, err2)
	}
	if n == 1 {
		return true, nil
	}
	rec, gerr := a.r.get(wctx2, a.r.pool, a.key)
	if gerr != nil {
		return false, errors.Join(err, gerr)
	}
	mine := rec.Owner == a.owner.String() || (want == StateStarted && rec.Owner == "")
	return rec.State == want && mine, nil
}

// outcomeErr turns a failed outcome write into the error Do returns.
func (a *attempt) outcomeErr(what string, ok bool, err error) error {
	if err != nil {
		a.r.logger.Error("Operation outcome not recorded", err, a.fields.Add(watermill.LogFields{"outcome": what}))
		return &transientError{fmt.Errorf("operation %s: %s: %w: %w", a.key, what, ErrNotRecorded, err)}
	}
	if !ok {
		a.r.logger.Error("Operation taken over before its outcome was recorded", ErrLostOwnership, a.fields.Add(watermill.LogFields{"outcome": what}))
		return &transientError{fmt.Errorf("operation %s: %s: %w", a.key, what, ErrLostOwnership)}
	}
	return nil
}

// call is step 3: the attempt owns a started record.
func (a *attempt) call(ctx context.Context, rec Record, call CallFunc) (Result, error) {
	k := a.key.String()
	if err := ctx.Err(); err != nil {
		ok, werr := a.write(ctx, StateStarted, a.r.sql.release, k, a.r.sql.owner(a.owner), storableText("not called: "+err.Error()))
		if oerr := a.outcomeErr("release", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		return Result{}, &transientError{fmt.Errorf("operation %s: not called: %w", k, err)}
	}
	crashpoint.Reached(crashAfterBegin)
	// The fence: the record must still be ours, its lease renewed, right
	// before the call (a worker paused past its lease finds another owner
	// and does not call).
	if ok, err := a.beat(ctx, a.conn); err != nil || !ok {
		if err == nil {
			a.r.logger.Error("Operation taken over before its call", ErrLostOwnership, a.fields)
			err = ErrLostOwnership
		} else {
			// The fence failed (the session may be gone), the provider was
			// not called: give the key back, on another connection if need
			// be, so that the retry calls rather than finding a dead
			// owner's started record and calling it uncertain.
			a.dirty = true
			ok, werr := a.write(ctx, StateStarted, a.r.sql.release, k, a.r.sql.owner(a.owner), storableText("not called: "+err.Error()))
			if werr != nil || !ok {
				a.r.logger.Info("Operation not called; key not released", a.fields.Add(watermill.LogFields{"err": errors.Join(err, werr)}))
			}
		}
		return Result{}, &transientError{fmt.Errorf("operation %s: not called: %w", k, err)}
	}
	res, err := a.callBeating(ctx, k, call)
	crashpoint.Reached(crashAfterCall)
	// What is recorded, and returned, is text every dialect stores.
	res.Reference = storableText(res.Reference)
	switch {
	case err == nil:
		ok, werr := a.write(ctx, StateSucceeded, a.r.sql.succeed, k, a.r.sql.owner(a.owner), res.Reference, res.Data)
		if oerr := a.outcomeErr("succeeded", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		res.Origin = OriginCall
		return res, nil
	case classOf(err) == classRejected:
		reason := storableText(err.Error())
		ok, werr := a.write(ctx, StateFailed, a.r.sql.fail, k, a.r.sql.owner(a.owner), res.Reference, reason)
		if oerr := a.outcomeErr("failed", ok, werr); oerr != nil {
			// The rejection is known and final for this message; the record
			// stays started and a later attempt will reconcile it.
			a.r.logger.Info("Operation rejected; rejection not recorded", a.fields.Add(watermill.LogFields{"err": oerr}))
		}
		return Result{}, &FailedError{Key: k, Reason: reason, Cause: err}
	case classOf(err) == classTransient:
		ok, werr := a.write(ctx, StateStarted, a.r.sql.release, k, a.r.sql.owner(a.owner), storableText(err.Error()))
		if oerr := a.outcomeErr("released", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		return Result{}, &transientError{fmt.Errorf("operation %s: provider: %w", k, err)}
	default:
		ref := res.Reference
		wctx, cancel := a.detached(ctx)
		defer cancel()
		stored, werr := a.markUncertain(wctx, res.Reference, storableText(err.Error()))
		if werr == nil {
			ref = stored
		} else {
			// Unrecorded, the record stays started with this attempt as its
			// owner: the next attempt finds it the same way, uncertain.
			a.r.logger.Info("Operation uncertain; state not recorded", a.fields.Add(watermill.LogFields{"err": werr}))
			a.dirty = true
		}
		a.r.logger.Info("Operation outcome uncertain", a.fields.Add(watermill.LogFields{"err": err, "reconcile": a.opts.reconcile != nil}))
		return Result{}, &UncertainError{Key: k, Kind: a.key.Kind(), Reference: ref, Attempts: rec.Attempts,
			Retry: a.opts.reconcile != nil, Cause: err}
	}
}

// markUncertain moves the attempt's started record to uncertain, on its
// connection, and returns the reference recorded.
func (a *attempt) markUncertain(ctx context.Context, reference, reason string) (string, error) {
	q := a.r.sql.uncertain
	args := q.args(a.key.String(), a.r.sql.owner(a.owner), reference, reason)
	if a.r.sql.returning {
		var stored string
		err := a.conn.QueryRow(ctx, q.sql, args...).Scan(&stored)
		return stored, err
	}
	n, err := a.conn.Exec(ctx, q.sql, args...)
	switch {
	case err != nil:
		return "", err
	case n != 1:
		return "", ErrLostOwnership
	}
	rec, err := a.r.get(ctx, a.conn, a.key)
	return rec.Reference, err
}

// reconcile settles an uncertain record the attempt owns, through the
// user's lookup.
func (a *attempt) reconcile(ctx context.Context, rec Record, call CallFunc) (Result, error) {
	k := a.key.String()
	res, err := a.opts.reconcile(ctx, rec)
	res.Reference = storableText(res.Reference)
	switch {
	case err == nil:
		ok, werr := a.write(ctx, StateSucceeded, a.r.sql.succeed, k, a.r.sql.owner(a.owner), res.Reference, res.Data)
		if oerr := a.outcomeErr("reconciled", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		a.r.logger.Info("Operation reconciled: succeeded", a.fields.Add(watermill.LogFields{"reference": res.Reference}))
		res.Origin = OriginReconciled
		return res, nil
	case errors.Is(err, ErrNotFound):
		ok, werr := a.write(ctx, StateStarted, a.r.sql.restart, k, a.r.sql.owner(a.owner))
		if oerr := a.outcomeErr("restart", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		a.r.logger.Info("Operation reconciled: not found at the provider, calling", a.fields)
		rec.State = StateStarted
		return a.call(ctx, rec, call)
	case classOf(err) == classRejected:
		reason := storableText(err.Error())
		ok, werr := a.write(ctx, StateFailed, a.r.sql.fail, k, a.r.sql.owner(a.owner), res.Reference, reason)
		if oerr := a.outcomeErr("failed", ok, werr); oerr != nil {
			a.r.logger.Info("Operation reconciled as rejected; not recorded", a.fields.Add(watermill.LogFields{"err": oerr}))
		}
		return Result{}, &FailedError{Key: k, Reason: reason, Cause: err}
	case ctx.Err() != nil:
		// Shutting down: not a verdict on the operation.
		return Result{}, &transientError{fmt.Errorf("operation %s: reconcile: %w", k, errors.Join(err, ctx.Err()))}
	default:
		return Result{}, &UncertainError{Key: k, Kind: a.key.Kind(), Reference: rec.Reference, Attempts: rec.Attempts,
			Retry: classOf(err) == classTransient, Cause: err}
	}
}

// acquireTimeout bounds Do's wait for a connection of the Runner's pool
// (a variable for tests).
var acquireTimeout = 10 * time.Second

// leaseDuration is how long a started record's owner is presumed alive
// after it last renewed the record (its begin, the fence before its call,
// the heartbeat during the call, every leaseDuration/3). A variable for
// tests.
var leaseDuration = 15 * time.Second

// errLeaseLive: the key's owner lost its session lock but renews its lease.
var errLeaseLive = errors.New("the owner's session lock is gone but its lease is live (a call in progress)")

// leaseLive reports whether the record's lease is live, in tx (false where
// the dialect has no lease: SQLite's lock belongs to the process).
func (a *attempt) leaseLive(ctx context.Context, tx tx) (bool, error) {
	q := a.r.sql.alive
	if q.sql == "" {
		return false, nil
	}
	var live bool
	if err := tx.QueryRow(ctx, q.sql, q.args(a.key.String(), leaseDuration.Microseconds())...).Scan(&live); err != nil {
		return false, fmt.Errorf("operation %s: lease: %w", a.key, err)
	}
	return live, nil
}

// beat renews the lease of the attempt's started record on q; false: the
// record is no longer this attempt's. True where the dialect has no lease.
func (a *attempt) beat(ctx context.Context, q sqldb.Querier) (bool, error) {
	st := a.r.sql.beat
	if st.sql == "" {
		return true, nil
	}
	wctx, cancel := a.detached(ctx)
	defer cancel()
	n, err := q.Exec(wctx, st.sql, st.args(a.key.String(), a.r.sql.owner(a.owner))...)
	return n == 1, err
}

// callBeating runs call with the heartbeat on; the heartbeat stops when
// call returns, panics or exits its goroutine.
func (a *attempt) callBeating(ctx context.Context, k string, call CallFunc) (Result, error) {
	stop := a.heartbeat(ctx)
	defer stop()
	return call(ctx, k)
}

// heartbeat renews the lease every leaseDuration/3 while the call runs, on
// the attempt's connection, or on another of the pool once that one failed
// (its session may be gone: idle_session_timeout, a terminated backend).
// stop ends it and waits for it.
func (a *attempt) heartbeat(ctx context.Context) (stop func()) {
	if a.r.sql.beat.sql == "" {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan bool)
	go func() {
		broken := false
		t := time.NewTicker(leaseDuration / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				finished <- broken
				return
			case <-t.C:
			}
			if !broken {
				if _, err := a.beat(ctx, a.conn); err == nil {
					continue
				}
				broken = true
			}
			_, _ = a.beat(ctx, poolQuerier{a})
		}
	}()
	return func() {
		close(done)
		if <-finished {
			a.dirty = true // the connection failed: close it rather than reuse it
			a.write0 = true
		}
	}
}

// poolExec runs one statement on a connection of the Runner's pool, up to
// three times while connections fail: the pool may hand out connections
// whose sessions the server ended while they sat idle (idle_session_timeout
// ends them all alike); each failure discards one. The statements it runs
// are owner-checked, so running one twice changes nothing.
func (a *attempt) poolExec(ctx context.Context, query string, args ...any) (int64, error) {
	var errs []error
	for try := 0; try < 3; try++ {
		n, err := a.r.pool.Exec(ctx, query, args...)
		if err == nil {
			return n, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil || statementRefused(err) {
			break // the statement's own error, or out of time
		}
	}
	return 0, errors.Join(errs...)
}

// statementRefused reports whether err is the server's answer to the
// statement on a live connection, which another connection would only
// meet again: a PostgreSQL error outside classes 08 (connection) and 57P
// (operator intervention: the session was ended), any SQLite error
// (Code() int: nothing to reconnect to), a MySQL server error other than
// 1053 (server shutdown), 1317 (query interrupted) and 1927 (connection
// killed).
func statementRefused(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return !strings.HasPrefix(pgErr.Code, "57P") && !strings.HasPrefix(pgErr.Code, "08")
	}
	var lite interface{ Code() int }
	if errors.As(err, &lite) {
		return true
	}
	if n, ok := sqldb.MySQLErrorNumber(err); ok {
		switch n {
		case "1053", "1317", "1927":
			return false
		}
		return true
	}
	return false
}

// poolQuerier runs Exec through poolExec (the heartbeat's fallback).
type poolQuerier struct{ a *attempt }

func (q poolQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	return q.a.poolExec(ctx, query, args...)
}

func (q poolQuerier) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	return q.a.r.pool.QueryRow(ctx, query, args...)
}
