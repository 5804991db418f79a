package operation

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/sqldb"
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
	// Pool is where the Runner takes its connections: one per Do, held from
	// the begin transaction until the outcome is recorded, including during
	// the external call (it carries the key's session-level advisory lock).
	// It must not be the connection of the caller's transaction, and it must
	// be a direct connection or a session-mode pooler: a transaction-mode
	// pooler (PgBouncer pool_mode=transaction) breaks session advisory locks.
	// Size it for the handlers that run at once, on top of the connections
	// their own transactions use, or give the Runner a pool of its own.
	// Required.
	Pool *pgxpool.Pool

	// Table is the operations table, "name" or "schema.name"; each part must
	// match [A-Za-z_][A-Za-z0-9_]{0,62}. Validated and quoted once, in
	// NewRunner. Defaults to DefaultTable.
	Table string

	// Wait bounds how long Do waits for the key when another live worker
	// holds it (the database's lock_timeout on the lock wait). When it
	// expires Do returns an InProgressError (transient). Defaults to
	// DefaultWait; a negative value means do not wait (an InProgressError at
	// once). Whole milliseconds; a positive value below 1ms counts as 1ms.
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
	if c.Pool == nil {
		return errors.New("operation: Config.Pool is required")
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
	pool         *pgxpool.Pool
	table        sqldb.Ident
	wait         time.Duration
	writeTimeout time.Duration
	logger       watermill.LoggerAdapter

	peekSQL, claimSQL, takeSQL, succeedSQL, failSQL          string
	uncertainSQL, releaseSQL, restartSQL, resolveSQL, getSQL string
}

// NewRunner validates cfg (on a copy with defaults applied) and builds the
// SQL text once. A nil logger is watermill.NopLogger. It does not touch the
// database: run Migrate (or apply MigrationsFS) first.
func NewRunner(cfg Config, logger watermill.LoggerAdapter) (*Runner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	table, _ := sqldb.ParseIdent(cfg.Table)
	q := table.Quoted(sqldb.PostgreSQL.QuoteChar())
	f := func(s string) string { return fmt.Sprintf(s, q, recordColumns) }
	return &Runner{
		pool:         cfg.Pool,
		table:        table,
		wait:         cfg.Wait,
		writeTimeout: cfg.WriteTimeout,
		logger:       logger,
		peekSQL:      f(pgPeek),
		claimSQL:     f(pgClaim),
		takeSQL:      f(pgTake),
		succeedSQL:   f(pgSucceed),
		failSQL:      f(pgFail),
		uncertainSQL: f(pgUncertain),
		releaseSQL:   f(pgRelease),
		restartSQL:   f(pgRestart),
		resolveSQL:   f(pgResolve),
		getSQL:       f(pgGet),
	}, nil
}

// Table is the runner's validated table identifier.
func (r *Runner) Table() sqldb.Ident { return r.table }

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
// The protocol, each step on a connection of Config.Pool, never on the
// caller's transaction:
//
//  1. Begin, in a short transaction of its own, committed before call runs:
//     take the key's lock (a session-level advisory lock, held until Do
//     returns), then insert the record as started, or read the existing one.
//     If another live worker holds the lock: a record with another
//     fingerprint is a ConflictError at once; otherwise wait up to
//     Config.Wait, then an InProgressError (transient).
//  2. An existing record is first compared by fingerprint, whatever its
//     state: another fingerprint is a ConflictError (permanent), returned
//     before any call, and the record is left as it is. Then, by state:
//     succeeded → its Result (Origin OriginStored), nothing called;
//     failed → a FailedError (permanent), nothing called;
//     started with no owner (the last call certainly did nothing) → call;
//     started with an owner, or uncertain → the owner died during a call (its
//     lock is free, so its session ended): the outcome is uncertain. With
//     WithReconcile, the reconcile function decides (found → success
//     recorded, OriginReconciled; ErrNotFound → call, same key; Rejected →
//     failed; Transient → a transient UncertainError). Without it, the record
//     is marked uncertain and Do returns a permanent UncertainError. Never a
//     blind call.
//  3. Call, then record the outcome in a second write, only if this attempt
//     still owns the record: success → succeeded with Reference and Data;
//     Rejected → failed, FailedError; Transient → started with no owner, a
//     transient error (the retry calls again, same key); Timeout or any
//     other error → uncertain, an UncertainError (transient with
//     WithReconcile, permanent without).
//
// A record is never deleted. Errors from the database are returned wrapped
// (%w), for the middleware to classify (connection loss, 55P03, … are
// transient). A zero key, a nil call or parameters Canonical refuses give a
// permanent error wrapping ErrInvalidKey or ErrInvalidParams.
//
// If call panics, the panic propagates after the lock is released; the
// record stays started with this attempt as owner, so the next attempt
// treats the outcome as uncertain.
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
	a, err := r.acquire(ctx, key, o)
	if err != nil {
		return Result{}, err
	}
	defer a.release()
	a.fp = fp

	d, rec, err := a.begin(ctx)
	if err != nil {
		return Result{}, err
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

func (r *Runner) get(ctx context.Context, q sqldb.PgxQuerier, key Key) (Record, error) {
	var s recordScan
	if err := q.QueryRow(ctx, r.getSQL, key.String()).Scan(s.dest()...); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
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
// first, waiting as Do does (InProgressError when a live worker keeps it), so
// it never moves a record under a live owner; the resolver becomes the
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
	tx, err := a.conn.Begin(ctx)
	if err != nil {
		return fmt.Errorf("operation %s: resolve: begin: %w", key, err)
	}
	defer a.rollback(tx)
	if err := a.lock(ctx, tx, false); err != nil {
		return err
	}
	rec, err := r.get(ctx, tx, key)
	if err != nil {
		return err
	}
	if rec.State == StateSucceeded || rec.State == StateFailed {
		return fmt.Errorf("operation %s: resolve: state %s: %w", key, rec.State, ErrFinal)
	}
	if _, err := tx.Exec(ctx, r.resolveSQL, key.String(), a.owner, string(v.state),
		v.result.Reference, v.result.Data, v.reason); err != nil {
		return fmt.Errorf("operation %s: resolve: %w", key, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("operation %s: resolve: commit: %w", key, err)
	}
	r.logger.Info("Operation resolved", watermill.LogFields{"key": key.String(), "from": string(rec.State), "to": string(v.state)})
	return nil
}

// lockID is the key's advisory lock number: a 64-bit FNV-1a hash of the key
// in a namespace of this package. Runners on different tables share the
// numbers; a collision only makes two keys wait for each other.
func lockID(k Key) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("watermill-idempotency/operation\x00"))
	_, _ = h.Write([]byte(k.String()))
	return int64(h.Sum64())
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
// whether its session holds the key's lock.
type attempt struct {
	r      *Runner
	key    Key
	fp     string
	opts   options
	owner  pgtype.UUID
	lockID int64
	conn   *pgxpool.Conn
	locked bool
	// dirty: the session's lock state is unknown (a failed lock or unlock):
	// the connection is closed rather than returned, which releases every
	// lock the session held.
	dirty  bool
	fields watermill.LogFields
}

func (r *Runner) acquire(ctx context.Context, key Key, o options) (*attempt, error) {
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("operation %s: acquire connection: %w", key, err)
	}
	owner := uuid.New()
	return &attempt{
		r: r, key: key, opts: o, conn: conn,
		owner:  pgtype.UUID{Bytes: owner, Valid: true},
		lockID: lockID(key),
		fields: watermill.LogFields{"key": key.String(), "owner": owner.String()},
	}, nil
}

// detached returns a context that outlives ctx's cancellation, bounded by
// the write timeout: outcome writes and unlocks must happen even when the
// handler's context ended.
func (a *attempt) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), a.r.writeTimeout)
}

func (a *attempt) rollback(tx pgx.Tx) {
	ctx, cancel := a.detached(context.Background())
	defer cancel()
	_ = tx.Rollback(ctx) // no-op after Commit
}

// release unlocks the key and returns the connection; on any doubt about the
// session's locks it closes the connection instead, which releases them.
func (a *attempt) release() {
	ctx, cancel := a.detached(context.Background())
	defer cancel()
	if a.locked && !a.dirty {
		var ok bool
		if err := a.conn.QueryRow(ctx, pgUnlock, a.lockID).Scan(&ok); err != nil || !ok {
			a.r.logger.Info("Operation unlock failed; closing the connection", a.fields.Add(watermill.LogFields{"err": err, "held": ok}))
			a.dirty = true
		}
	}
	if a.dirty {
		_ = a.conn.Conn().Close(ctx)
	}
	a.conn.Release()
}

// lock takes the key's session lock inside tx. If another session holds it:
// with peek, a recorded fingerprint other than a.fp is a ConflictError at
// once; then wait up to opts.wait, or return an InProgressError.
func (a *attempt) lock(ctx context.Context, tx pgx.Tx, peek bool) error {
	var got bool
	if err := tx.QueryRow(ctx, pgTryLock, a.lockID).Scan(&got); err != nil {
		a.dirty = true
		return fmt.Errorf("operation %s: lock: %w", a.key, err)
	}
	if got {
		a.locked = true
		return nil
	}
	if peek {
		var stored string
		err := tx.QueryRow(ctx, a.r.peekSQL, a.key.String()).Scan(&stored)
		switch {
		case err == nil && stored != a.fp:
			return &ConflictError{Key: a.key.String(), Fingerprint: a.fp, StoredFingerprint: stored}
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("operation %s: peek: %w", a.key, err)
		}
	}
	if a.opts.wait <= 0 {
		return &InProgressError{Key: a.key.String()}
	}
	ms := max(a.opts.wait.Milliseconds(), 1)
	if _, err := tx.Exec(ctx, pgLockTimeout, fmt.Sprintf("%dms", ms)); err != nil {
		return fmt.Errorf("operation %s: set lock_timeout: %w", a.key, err)
	}
	if _, err := tx.Exec(ctx, pgLock, a.lockID); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			return &InProgressError{Key: a.key.String(), Err: err}
		}
		a.dirty = true // cancelled or broken: the lock may have been granted
		return fmt.Errorf("operation %s: wait for lock: %w", a.key, err)
	}
	a.locked = true
	return nil
}

// begin is step 1 and 2 of Do, in one short transaction committed before
// any call.
func (a *attempt) begin(ctx context.Context) (decision, Record, error) {
	tx, err := a.conn.Begin(ctx)
	if err != nil {
		return 0, Record{}, fmt.Errorf("operation %s: begin: %w", a.key, err)
	}
	defer a.rollback(tx)
	if err := a.lock(ctx, tx, true); err != nil {
		return 0, Record{}, err
	}
	var (
		inserted bool
		s        recordScan
	)
	dest := append([]any{&inserted}, s.dest()...)
	if err := tx.QueryRow(ctx, a.r.claimSQL, a.key.String(), a.owner, a.key.Kind(), a.fp).Scan(dest...); err != nil {
		return 0, Record{}, fmt.Errorf("operation %s: claim: %w", a.key, err)
	}
	rec := s.record()
	d, err := a.decide(ctx, tx, inserted, &rec)
	if err != nil {
		return 0, Record{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, Record{}, fmt.Errorf("operation %s: commit begin: %w", a.key, err)
	}
	return d, rec, nil
}

// decide applies step 2 to the claimed or found record, under the lock,
// taking ownership in tx where the attempt goes on.
func (a *attempt) decide(ctx context.Context, tx pgx.Tx, inserted bool, rec *Record) (decision, error) {
	if inserted {
		return decideCall, nil
	}
	// Every path that returns an existing record starts here.
	if rec.Fingerprint != a.fp {
		return 0, &ConflictError{Key: a.key.String(), Fingerprint: a.fp, StoredFingerprint: rec.Fingerprint, State: rec.State}
	}
	take := func(to State) error {
		prev := pgtype.UUID{}
		if rec.Owner != "" {
			u, err := uuid.Parse(rec.Owner)
			if err != nil {
				return fmt.Errorf("operation %s: stored owner %q: %w", a.key, rec.Owner, err)
			}
			prev = pgtype.UUID{Bytes: u, Valid: true}
		}
		var attempts int32
		err := tx.QueryRow(ctx, a.r.takeSQL, a.key.String(), a.owner, string(to), string(rec.State), prev).Scan(&attempts)
		if errors.Is(err, pgx.ErrNoRows) {
			return &transientError{fmt.Errorf("operation %s: record moved while locked (edited outside the Runner?)", a.key)}
		}
		if err != nil {
			return fmt.Errorf("operation %s: take: %w", a.key, err)
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
		// We hold the lock, so the owner's session is gone: it died
		// between its begin and its outcome write. Its call may have run.
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
func (a *attempt) write(ctx context.Context, want State, sql string, args ...any) (bool, error) {
	wctx, cancel := a.detached(ctx)
	defer cancel()
	tag, err := a.conn.Exec(wctx, sql, args...)
	if err == nil {
		return tag.RowsAffected() == 1, nil
	}
	a.r.logger.Info("Operation outcome write failed; retrying on another connection", a.fields.Add(watermill.LogFields{"err": err}))
	a.dirty = true
	wctx2, cancel2 := a.detached(ctx)
	defer cancel2()
	tag, err2 := a.r.pool.Exec(wctx2, sql, args...)
	if err2 != nil {
		return false, errors.Join(err, err2)
	}
	if tag.RowsAffected() == 1 {
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
		ok, werr := a.write(ctx, StateStarted, a.r.releaseSQL, k, a.owner, "not called: "+err.Error())
		if oerr := a.outcomeErr("release", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		return Result{}, &transientError{fmt.Errorf("operation %s: not called: %w", k, err)}
	}
	crashpoint.Reached(crashAfterBegin)
	res, err := call(ctx, k)
	crashpoint.Reached(crashAfterCall)
	switch {
	case err == nil:
		ok, werr := a.write(ctx, StateSucceeded, a.r.succeedSQL, k, a.owner, res.Reference, res.Data)
		if oerr := a.outcomeErr("succeeded", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		res.Origin = OriginCall
		return res, nil
	case classOf(err) == classRejected:
		ok, werr := a.write(ctx, StateFailed, a.r.failSQL, k, a.owner, res.Reference, err.Error())
		if oerr := a.outcomeErr("failed", ok, werr); oerr != nil {
			// The rejection is known and final for this message; the record
			// stays started and a later attempt will reconcile it.
			a.r.logger.Info("Operation rejected; rejection not recorded", a.fields.Add(watermill.LogFields{"err": oerr}))
		}
		return Result{}, &FailedError{Key: k, Reason: err.Error(), Cause: err}
	case classOf(err) == classTransient:
		ok, werr := a.write(ctx, StateStarted, a.r.releaseSQL, k, a.owner, err.Error())
		if oerr := a.outcomeErr("released", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		return Result{}, &transientError{fmt.Errorf("operation %s: provider: %w", k, err)}
	default:
		ref := res.Reference
		wctx, cancel := a.detached(ctx)
		defer cancel()
		var stored string
		werr := a.conn.QueryRow(wctx, a.r.uncertainSQL, k, a.owner, res.Reference, err.Error()).Scan(&stored)
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

// reconcile settles an uncertain record the attempt owns, through the
// user's lookup.
func (a *attempt) reconcile(ctx context.Context, rec Record, call CallFunc) (Result, error) {
	k := a.key.String()
	res, err := a.opts.reconcile(ctx, rec)
	switch {
	case err == nil:
		ok, werr := a.write(ctx, StateSucceeded, a.r.succeedSQL, k, a.owner, res.Reference, res.Data)
		if oerr := a.outcomeErr("reconciled", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		a.r.logger.Info("Operation reconciled: succeeded", a.fields.Add(watermill.LogFields{"reference": res.Reference}))
		res.Origin = OriginReconciled
		return res, nil
	case errors.Is(err, ErrNotFound):
		ok, werr := a.write(ctx, StateStarted, a.r.restartSQL, k, a.owner)
		if oerr := a.outcomeErr("restart", ok, werr); oerr != nil {
			return Result{}, oerr
		}
		a.r.logger.Info("Operation reconciled: not found at the provider, calling", a.fields)
		rec.State = StateStarted
		return a.call(ctx, rec, call)
	case classOf(err) == classRejected:
		ok, werr := a.write(ctx, StateFailed, a.r.failSQL, k, a.owner, res.Reference, err.Error())
		if oerr := a.outcomeErr("failed", ok, werr); oerr != nil {
			a.r.logger.Info("Operation reconciled as rejected; not recorded", a.fields.Add(watermill.LogFields{"err": oerr}))
		}
		return Result{}, &FailedError{Key: k, Reason: err.Error(), Cause: err}
	case ctx.Err() != nil:
		// Shutting down: not a verdict on the operation.
		return Result{}, &transientError{fmt.Errorf("operation %s: reconcile: %w", k, errors.Join(err, ctx.Err()))}
	default:
		return Result{}, &UncertainError{Key: k, Kind: a.key.Kind(), Reference: rec.Reference, Attempts: rec.Attempts,
			Retry: classOf(err) == classTransient, Cause: err}
	}
}
