package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// TxBeginner opens the transaction of one attempt and claims the event in it.
// It is the driver seam of the middleware; build one with NewPgxBeginner or
// NewStdBeginner. The interface is sealed (its method is unexported) so the
// library can change how transactions are begun without breaking callers.
type TxBeginner interface {
	beginClaim(ctx context.Context, c claimRequest) (attemptTx, bool, error)
}

type claimRequest struct {
	store    *processedstore.Store
	consumer string
	eventID  uuid.UUID
	// identity is stored with the claim and compared on a duplicate
	// (payload verification, identity.go) when verify is set.
	identity processedstore.Identity
	verify   bool
	// eventAt is the event's occurred_at for ids that carry no time (zero:
	// unknown); the store dates a UUIDv7 by its id (processedstore.EventTime).
	eventAt time.Time
	// lockTimeout is the dialect's lock-timeout statement and arguments,
	// built once by NewIdempotent; nil → leave the session's lock timeout
	// alone.
	lockTimeout *lockTimeoutStmt
}

type lockTimeoutStmt struct {
	query string
	args  []any
	d     time.Duration // the timeout (the prepared claim sets it itself)
}

// newLockTimeoutStmt builds the statement for d, or nil when d ≤ 0 or the
// dialect has none.
func newLockTimeoutStmt(store *processedstore.Store, d time.Duration) *lockTimeoutStmt {
	if d <= 0 {
		return nil
	}
	q, args, ok := store.LockTimeoutQuery(d)
	if !ok {
		return nil
	}
	return &lockTimeoutStmt{query: q, args: args, d: d}
}

// lockTimeoutQuery is the dialect's lock-timeout statement, if any.
func (c claimRequest) lockTimeoutQuery() (string, []any, bool) {
	if c.lockTimeout == nil {
		return "", nil, false
	}
	return c.lockTimeout.query, c.lockTimeout.args, true
}

// attemptTx is one attempt's transaction as the middleware sees it.
type attemptTx interface {
	// bind returns ctx carrying the transaction for the handler.
	bind(ctx context.Context) context.Context
	commit(ctx context.Context) error
	// rollback ends the transaction; safe after commit (no-op) and twice.
	rollback(ctx context.Context) error
	// release returns the connection to its pool; it must be called once,
	// after commit or rollback, on every path.
	release()
	// outboxExec is the transaction as watermill-sql sees it (outbox writes).
	outboxExec() wsql.ContextExecutor
	// parts is the transaction as the handler sees it: as a sqldb.Querier
	// (nil when p is set: the attempt's state adapts p itself), and the
	// driver's own type (one of p and s is nil), for the one context value
	// of the attempt (attemptState).
	parts() (q sqldb.Querier, p pgx.Tx, s *sql.Tx)
}

// PgxBeginnerConfig configures NewPgxBeginner.
type PgxBeginnerConfig struct {
	// DisablePipeline makes each attempt begin with pgx's own BeginTx (one
	// round trip) and then claim (a second one), instead of sending BEGIN and
	// the claim together in one pgx.Batch. The handler then gets pgx's own
	// transaction type. Defaults to false (pipelined): the claim costs no round
	// trip of its own.
	DisablePipeline bool
}

// ErrNilHandle: a beginner was built on a nil pool or *sql.DB.
var ErrNilHandle = errors.New("middleware: nil database handle")

// NewPgxBeginner returns the pgx v5 TxBeginner over pool. By default BEGIN,
// the transaction's lock timeout and the claim travel in one round trip and
// the handler receives a pgx.Tx of this package that runs on that
// connection (see PgxTxFromContext). On a pool whose
// ConnConfig.DefaultQueryExecMode is pgx.QueryExecModeCacheStatement (pgx's
// default) they are statements of the beginner's own, prepared once per
// connection (named "idempotency_" and a hash of their SQL, as pgx names
// its cached statements: a pooler that shares server connections never
// runs one of another SQL under the name; the claim sets the lock timeout
// itself, see Config.LockTimeout) and sent in one pgconn.Batch with
// parameters the beginner encodes; a connection that lost them (DISCARD
// ALL, DEALLOCATE ALL) prepares them again once, and a connection whose
// server session is shared with other clients (a transaction pooler that
// does not track prepared statements: 42P05 on a name it never prepared,
// or statements lost again right after they were prepared) makes the
// beginner send them unnamed, in the same one round trip, from then on.
// In the other modes
// (simple protocol, exec/describe for poolers such as pgbouncer) they are a
// pgx.Batch in the pool's mode. A pgx.BatchTracer on the pool sees the
// batch either way. A nil pool is an error wrapping ErrNilHandle.
func NewPgxBeginner(pool *pgxpool.Pool, cfg PgxBeginnerConfig) (TxBeginner, error) {
	if pool == nil {
		return nil, fmt.Errorf("middleware: NewPgxBeginner: pool: %w", ErrNilHandle)
	}
	b := &pgxBeginner{pool: pool, pipeline: !cfg.DisablePipeline}
	cc := pool.Config().ConnConfig
	b.prepared = b.pipeline && cc.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
	switch cc.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec:
		b.describesFirst = true
	}
	b.tracer, _ = cc.Tracer.(pgx.BatchTracer)
	b.traced = cc.Tracer != nil
	return b, nil
}

type pgxBeginner struct {
	pool     *pgxpool.Pool
	pipeline bool
	// prepared: the pool prepares statements (QueryExecModeCacheStatement),
	// so the claim's batch is sent with statements of its own prepared once
	// per connection (pgxclaim.go); otherwise a pgx.Batch in the pool's mode.
	prepared bool
	// describesFirst: in the pool's exec mode pgx describes (or prepares)
	// a pgx.Batch's statements before it executes any of them.
	describesFirst bool
	// tracer is the pool's pgx.BatchTracer, if any: the prepared claim's
	// batch is traced as a pgx.Batch would be.
	tracer pgx.BatchTracer
	// traced: the pool has a pgx tracer of any kind.
	traced bool
	// pooled: a server session was seen shared with other clients (a
	// transaction pooler, pgxclaim.go): statements are sent unnamed from
	// then on.
	pooled atomic.Bool
	// session: what the claims found of the pool's server sessions
	// (sessionLock compares their process IDs): sessionUnknown,
	// sessionDirect (each connection's own) or sessionShared (a pooler's,
	// for good). OwnQuerier reads it.
	session atomic.Int32
	// probing: probeSession is running.
	probing atomic.Bool
	// schemas: the commit guard's table per store (commitguard.go).
	schemas guardSchemas
}

func (b *pgxBeginner) beginClaim(ctx context.Context, c claimRequest) (attemptTx, bool, error) {
	if !b.pipeline {
		return b.beginClaimUnpipelined(ctx, c)
	}
	conn, err := b.pool.Acquire(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("acquire connection: %w", err)
	}
	if b.prepared {
		var id *processedstore.Identity
		if c.verify {
			id = &c.identity
		}
		if p, ok := c.store.ClaimParamsAt(c.consumer, c.eventID, c.eventAt, id); ok {
			st := connClaimOf(conn.Conn().PgConn())
			claimed, err := b.claimPrepared(ctx, st, conn.Conn(), &c, &p)
			if err != errFallback {
				tx, claimed, err := b.claimed(ctx, st, conn, &c, claimed, err)
				if ptx, ok := tx.(*pgxTx); ok {
					ptx.prepared, ptx.tracer, ptx.pooled, ptx.pinned = true, b.tracer, &b.pooled, claimed && p.Pinned
					if claimed && ptx.guard.sql != "" {
						if err := b.prepareGuard(ctx, st, ptx.pc, ptx.guard.sql); err != nil {
							_ = ptx.rollback(ctx)
							ptx.release()
							return nil, false, err
						}
					}
				}
				return tx, claimed, err
			}
		}
	}
	batch := &pgx.Batch{}
	if q, args, ok := c.lockTimeoutQuery(); ok && b.describesFirst {
		// pgx describes a batch's statements (Parse, Describe, Sync)
		// before it runs the first: the claim's parse would wait for the
		// claim table's lock outside the transaction, unbounded. BEGIN
		// and the lock timeout go first, in a round trip of their own.
		var err error
		if len(args) == 0 {
			_, err = conn.Exec(ctx, "begin; "+q, pgx.QueryExecModeSimpleProtocol)
		} else if _, err = conn.Exec(ctx, "begin", pgx.QueryExecModeSimpleProtocol); err == nil {
			_, err = conn.Exec(ctx, q, append([]any{pgx.QueryExecModeSimpleProtocol}, args...)...)
		}
		if err != nil {
			return b.claimed(ctx, connClaimOf(conn.Conn().PgConn()), conn, &c, false, err)
		}
	} else {
		batch.Queue("begin")
		if ok {
			batch.Queue(q, args...)
		}
	}
	claimSQL, claimArgs := c.claimQuery()
	batch.Queue(claimSQL, claimArgs...)
	br := conn.SendBatch(ctx, batch)
	var tagErr error
	var claimed bool
	n := batch.Len()
	for i := 0; i < n; i++ {
		tag, err := br.Exec()
		if err != nil {
			tagErr = err
			break
		}
		if i == n-1 {
			claimed = tag.RowsAffected() == 1
		}
	}
	closeErr := br.Close()
	if tagErr == nil {
		tagErr = closeErr
	}
	return b.claimed(ctx, connClaimOf(conn.Conn().PgConn()), conn, &c, claimed, tagErr)
}

// claimed is the attempt's transaction on conn after the claim's batch; on
// err the transaction is rolled back and conn released. A claimed
// attempt's commit is guarded (commitguard.go).
func (b *pgxBeginner) claimed(ctx context.Context, st *connClaim, conn *pgxpool.Conn, c *claimRequest, claimed bool, err error) (attemptTx, bool, error) {
	tx := &pgxTx{conn: conn, pc: conn.Conn(), traced: b.traced}
	// Every attempt's handler is scanned on its connection's state, also
	// where the claim was not prepared: what it leaves on the connection
	// (tx.Conn, a statement prepared from unproven SQL) reaches a later
	// pinned attempt there.
	tx.savepoints, tx.scan, tx.session = &tx.spCount, &tx.scanV, st
	if err != nil {
		_ = tx.rollback(ctx)
		tx.release()
		return nil, false, err
	}
	if claimed {
		tx.guard, err = b.schemas.guard(ctx, c, func(ctx context.Context, q string) (string, error) {
			var s string
			return s, tx.pc.QueryRow(ctx, q).Scan(&s)
		})
		if err != nil {
			_ = tx.rollback(ctx)
			tx.release()
			return nil, false, err
		}
	}
	return tx, claimed, nil
}

func (b *pgxBeginner) beginClaimUnpipelined(ctx context.Context, c claimRequest) (attemptTx, bool, error) {
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("begin: %w", err)
	}
	a := &pgxNativeTx{tx: tx}
	if q, args, ok := c.lockTimeoutQuery(); ok {
		if _, err := tx.Exec(ctx, q, args...); err != nil {
			_ = a.rollback(ctx)
			return nil, false, err
		}
	}
	claimed, err := c.claim(ctx, sqldb.Pgx(tx))
	if err != nil {
		_ = a.rollback(ctx)
		return nil, false, err
	}
	if claimed {
		a.guard, err = b.schemas.guard(ctx, &c, func(ctx context.Context, q string) (string, error) {
			var s string
			return s, tx.QueryRow(ctx, q).Scan(&s)
		})
		if err != nil {
			_ = a.rollback(ctx)
			return nil, false, err
		}
	}
	return a, claimed, nil
}

// pgxNativeTx is an attempt on pgx's own transaction type.
type pgxNativeTx struct {
	tx    pgx.Tx
	guard commitGuard // a claimed attempt's (commitguard.go)
}

func (a *pgxNativeTx) bind(ctx context.Context) context.Context {
	ctx = context.WithValue(ctx, pgxTxKey{}, a.tx)
	return sqldb.ContextWithTx(ctx, sqldb.Pgx(a.tx))
}

// commit commits pgx's transaction, unless a handler statement ended it
// (the connection is idle outside a transaction, or in another one: see
// pgxTx.commit). pgx's transaction sends COMMIT itself, so the guard is a
// round trip of its own here.
func (a *pgxNativeTx) commit(ctx context.Context) error {
	if a.tx.Conn().PgConn().TxStatus() == 'I' {
		return errHandlerEndedBySQL
	}
	if a.guard.sql != "" {
		var one int64
		if err := a.tx.QueryRow(ctx, a.guard.sql, a.guard.args()...).Scan(&one); err != nil {
			if sqlState(err) == "25P02" {
				return a.tx.Commit(ctx) // aborted by a handler statement: the commit reports it
			}
			return checkGuard(err)
		}
	}
	return a.tx.Commit(ctx)
}
func (a *pgxNativeTx) rollback(ctx context.Context) error {
	err := a.tx.Rollback(ctx)
	if err == pgx.ErrTxClosed {
		return nil
	}
	return err
}

// release is a no-op: pgxpool's Tx returns its connection on Commit/Rollback.
func (a *pgxNativeTx) release() {}

func (a *pgxNativeTx) outboxExec() wsql.ContextExecutor { return wsql.TxFromPgx(a.tx) }

func (a *pgxNativeTx) parts() (sqldb.Querier, pgx.Tx, *sql.Tx) { return nil, a.tx, nil }

// NewStdBeginner returns the database/sql TxBeginner over db (tested with
// pgx's stdlib driver on PostgreSQL). Each attempt costs BeginTx, the lock
// timeout and the claim as separate round trips; use NewPgxBeginner for the
// fast path. The handler gets the *sql.Tx (SQLTxFromContext). A nil db is an
// error wrapping ErrNilHandle.
func NewStdBeginner(db *sql.DB) (TxBeginner, error) {
	if db == nil {
		return nil, fmt.Errorf("middleware: NewStdBeginner: db: %w", ErrNilHandle)
	}
	return &stdBeginner{db: db}, nil
}

type stdBeginner struct {
	db      *sql.DB
	schemas guardSchemas // the commit guard's table per store (commitguard.go)
}

// outside is the database outside any attempt (DBFromContext).
func (b *stdBeginner) outside() sqldb.Querier { return sqldb.Std(b.db) }

// outside is the database outside any attempt (DBFromContext).
// outside runs in QueryExecModeExec (sqldb.OwnMode): its statements
// (a claim's visibility, a retirement without RetireDB) go on their own,
// behind a transaction pooler too.
func (b *pgxBeginner) outside() sqldb.Querier { return sqldb.PgxIn(b.pool, sqldb.OwnMode(b.pool)) }

func (b *stdBeginner) beginClaim(ctx context.Context, c claimRequest) (attemptTx, bool, error) {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, false, fmt.Errorf("begin: %w", err)
	}
	a := &stdTx{tx: tx}
	if q, args, ok := c.lockTimeoutQuery(); ok {
		if _, err := tx.ExecContext(ctx, q, args...); err != nil {
			_ = a.rollback(ctx)
			return nil, false, err
		}
	}
	claimed, err := c.claim(ctx, sqldb.Std(tx))
	if err != nil {
		_ = a.rollback(ctx)
		return nil, false, err
	}
	if claimed {
		a.guard, err = b.schemas.guard(ctx, &c, func(ctx context.Context, q string) (string, error) {
			var s string
			return s, tx.QueryRowContext(ctx, q).Scan(&s)
		})
		if err != nil {
			_ = a.rollback(ctx)
			return nil, false, err
		}
		if a.guard.sql == "" {
			// MySQL, SQLite: the transaction's marker (commitguard.go).
			if _, err := tx.ExecContext(ctx, "SAVEPOINT "+claimSavepoint); err != nil {
				_ = a.rollback(ctx)
				return nil, false, err
			}
			a.savepoint = true
		}
	}
	return a, claimed, nil
}

type stdTx struct {
	tx *sql.Tx
	// guard is a claimed attempt's guard statement on PostgreSQL;
	// savepoint: claimSavepoint was set after the claim (MySQL, SQLite).
	guard     commitGuard
	savepoint bool
}

func (a *stdTx) bind(ctx context.Context) context.Context {
	ctx = context.WithValue(ctx, sqlTxKey{}, a.tx)
	return sqldb.ContextWithTx(ctx, sqldb.Std(a.tx))
}

// commit commits the attempt after checking that its transaction is still
// the claim's (database/sql cannot see a ROLLBACK, COMMIT, END, ABORT or
// BEGIN a handler sends through ExecContext; COMMIT would then only warn,
// or commit another transaction, and the delivery be acked without its
// claim): on PostgreSQL the guard statement (one round trip), on MySQL and
// SQLite the RELEASE of claimSavepoint (commitguard.go). A handler that
// ended it fails the attempt with errHandlerEndedBySQL.
func (a *stdTx) commit(ctx context.Context) error {
	switch {
	case a.guard.sql != "":
		if err := a.runGuard(ctx); err != nil {
			if errors.Is(err, sql.ErrTxDone) {
				return err
			}
			if sqlState(err) == "25P02" {
				return a.tx.Commit() // aborted by a handler statement: the commit reports it
			}
			if err = checkGuard(err); errors.Is(err, errHandlerEndedBySQL) {
				_ = a.tx.Rollback()
			}
			return err
		}
	case a.savepoint:
		if err := releaseClaimSavepoint(ctx, a.tx); err != nil {
			return err
		}
	}
	return a.tx.Commit()
}

// runGuard sends the commit guard's statement on the attempt's
// transaction: it fails with processedstore.GuardFailed (guardFailed) when
// the claim is not the current transaction's.
func (a *stdTx) runGuard(ctx context.Context) error {
	var one int64
	return a.tx.QueryRowContext(ctx, a.guard.sql, a.guard.consumer, a.guard.eventID).Scan(&one)
}

func (a *stdTx) rollback(context.Context) error {
	err := a.tx.Rollback()
	if err == sql.ErrTxDone {
		return nil
	}
	return err
}
func (a *stdTx) release() {}

func (a *stdTx) outboxExec() wsql.ContextExecutor { return wsql.TxFromStdSQL(a.tx) }

func (a *stdTx) parts() (sqldb.Querier, pgx.Tx, *sql.Tx) { return sqldb.Std(a.tx), nil, a.tx }
