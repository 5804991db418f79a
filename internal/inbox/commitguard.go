package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// The commit guard (issue 27 item 4): a handler that ends the attempt's
// transaction by SQL (ROLLBACK, COMMIT, END, ABORT, COMMIT AND CHAIN, or
// one of them followed by BEGIN) is detected at commit, so that the
// delivery is never acked while its claim is gone or was committed apart
// from the effects that follow it.
//
//   - PostgreSQL: the store's guard statement (processedstore.ClaimGuardQuery:
//     the claim row's xmin must be this transaction's id, else 22012) runs
//     before COMMIT. On the pipelined pgx beginner it is sent with COMMIT
//     in one batch (one Sync, no round trip of its own): when it fails, the
//     server skips the COMMIT and the transaction is rolled back, so the
//     statements the handler ran after its own BEGIN are not committed
//     either. On pgx's own transaction (DisablePipeline) and database/sql
//     it is one statement before COMMIT.
//   - MySQL and SQLite (database/sql): a savepoint (claimSavepoint) set
//     right after the claim is the transaction's marker: any end of the
//     transaction drops it, a new BEGIN does not bring it back, so the
//     RELEASE SAVEPOINT sent before COMMIT fails.

// commitGuard is what pgxTx.commit checks: the store's guard statement for
// the attempt's claim ("" when there is none: a savepoint, a dialect
// without one).
type commitGuard struct {
	sql      string
	consumer string
	eventID  uuid.UUID
}

// guardSchemas caches, per store, the schema its unqualified claim table
// resolves to on a beginner's connections: resolved once (one statement),
// before the first prepared claim (which then names that schema,
// processedstore.Store.QualifyClaim) or else in the first claimed attempt,
// after the claim and before its handler runs, so that the guard names the
// claim's table whatever search_path the handler sets
// (processedstore.ClaimGuardSchemaQuery).
type guardSchemas struct{ m sync.Map } // *processedstore.Store → string

// schemaOf returns store's schema, resolved by query the first time; ""
// for a qualified table, a dialect without schemas or a table not found.
func (g *guardSchemas) schemaOf(ctx context.Context, store *processedstore.Store, query func(ctx context.Context, sql string) (string, error)) (string, error) {
	q, ok := store.ClaimGuardSchemaQuery()
	if !ok {
		return "", nil
	}
	if v, ok := g.m.Load(store); ok {
		return v.(string), nil
	}
	s, err := query(ctx, q)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) && !errors.Is(err, sql.ErrNoRows) {
		return "", err
	}
	if s != "" {
		// Kept once found. A table not found yet (a consumer started
		// before processed.Migrate: its claims fail with 42P01) is looked
		// up again by the next attempt, so the schema it is created in is
		// the one every later claim and guard names.
		g.m.Store(store, s)
	}
	return s, nil
}

// guard is the commit guard of c's claim (claimed), on the transaction
// that query runs its statement on.
func (g *guardSchemas) guard(ctx context.Context, c *claimRequest, query func(ctx context.Context, sql string) (string, error)) (commitGuard, error) {
	schema, err := g.schemaOf(ctx, c.store, query)
	if err != nil {
		return commitGuard{}, err
	}
	q, ok := c.store.ClaimGuardQuery(c.consumer, c.eventID, schema)
	if !ok {
		return commitGuard{}, nil
	}
	return commitGuard{sql: q, consumer: c.consumer, eventID: c.eventID}, nil
}

func (g commitGuard) args() []any {
	return []any{g.consumer, pgtype.UUID{Bytes: g.eventID, Valid: true}}
}

// guardFailed reports whether err is the guard statement's own failure
// (processedstore.GuardFailed) rather than the connection's or an aborted
// transaction's.
func guardFailed(err error) bool { return sqlState(err) == processedstore.GuardFailed }

// prepareGuard prepares the guard and COMMIT on conn, once per
// connection, when the beginner names its statements: inside the claimed
// attempt's transaction, after the claim, whose lock on the claim table
// makes the guard's parse wait on no other transaction (a PREPARE outside
// it would wait on a LOCK TABLE unbounded by the lock timeout). A failed
// PREPARE aborts the transaction, so its error fails the attempt; 42P05
// (a pooler sharing the server session) makes the beginner send its
// statements unnamed from then on (the retry succeeds).
func (b *pgxBeginner) prepareGuard(ctx context.Context, st *connClaim, conn *pgx.Conn, guard string) error {
	pc := conn.PgConn()
	if b.pooled.Load() || st.guardUnnamed || st.guardReady == guard {
		return nil
	}
	_, err := st.stmt(ctx, pc, guard, identityReadTypes)
	if err == nil {
		_, err = st.stmt(ctx, pc, "commit", nil)
	}
	if err == nil {
		st.guardReady = guard
	}
	if err == errPooled {
		b.pooled.Store(true)
		st.forget()
	}
	return err
}

// findStmt returns sql's statement on the connection if it is prepared
// and usable, without preparing it.
func (st *connClaim) findStmt(sql string) (preparedStmt, bool) {
	for _, s := range st.stmts {
		if s.sql == sql {
			return s, s.ok
		}
	}
	return preparedStmt{}, false
}

// commitGuarded sends the guard and COMMIT in one round trip and closes
// the transaction: errHandlerEndedBySQL when the guard failed, the error
// of a failed statement otherwise, pgx.ErrTxCommitRollback when COMMIT
// answered ROLLBACK. A transaction left open or aborted by a failure is
// rolled back (the connection closed if that fails too).
func (tx *pgxTx) commitGuarded(ctx context.Context) error {
	tx.closed = true
	var tag pgconn.CommandTag
	var err error
	if tx.prepared {
		tag, err = tx.sendGuardPrepared(ctx)
	} else {
		b := &pgx.Batch{}
		b.Queue(tx.guard.sql, tx.guard.args()...)
		b.Queue("commit")
		br := tx.pc.SendBatch(ctx, b)
		_, err = br.Exec()
		if err == nil {
			tag, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	}
	if (err == nil && tag.String() == "ROLLBACK") || sqlState(err) == "25P02" {
		// A statement of the handler failed and aborted the transaction
		// (the guard then fails with 25P02): COMMIT would have answered
		// ROLLBACK.
		err = pgx.ErrTxCommitRollback
	}
	if err == nil && tag.String() != "COMMIT" {
		return errNotCommitted(ctx, tx, tag)
	}
	if err != nil && !tx.pc.IsClosed() {
		err = tx.endAfterBatch(ctx, err)
	}
	if guardFailed(err) {
		return fmt.Errorf("%w (the commit guard found the claim's row written outside this transaction: %w)", errHandlerEndedBySQL, err)
	}
	return err
}

// sendGuardPrepared is commitGuarded's batch after a prepared claim: the
// guard and COMMIT as the connection's prepared statements (prepareGuard),
// or unnamed (Parse, Bind, Execute) when they are not prepared, behind a
// pooler, or on a connection that lost them once, with the parameters
// encoded as the claim's. It returns COMMIT's tag.
func (tx *pgxTx) sendGuardPrepared(ctx context.Context) (pgconn.CommandTag, error) {
	pc := tx.pc.PgConn()
	st := tx.session
	st.text[0] = append(st.text[0][:0], tx.guard.consumer...)
	st.vals[0] = st.text[0]
	st.uuid = tx.guard.eventID
	st.vals[1] = st.uuid[:]
	vals := st.vals[:2]
	var batch pgconn.Batch
	guard, okG := st.findStmt(tx.guard.sql)
	commit, okC := st.findStmt("commit")
	named := okG && okC && (tx.pooled == nil || !tx.pooled.Load()) && !st.guardUnnamed
	if named {
		batch.ExecPrepared(guard.name, vals, st.formats[:2], nil)
		batch.ExecPrepared(commit.name, nil, nil, nil)
	} else {
		batch.ExecParams(tx.guard.sql, vals, identityReadOIDs, st.formats[:2], nil)
		batch.ExecParams("commit", nil, nil, nil, nil)
	}
	var tb *pgx.Batch
	if tx.tracer != nil {
		tb = &pgx.Batch{}
		tb.Queue(tx.guard.sql, tx.guard.consumer, tx.guard.eventID)
		tb.Queue("commit")
		ctx = tx.tracer.TraceBatchStart(ctx, tx.pc, pgx.TraceBatchStartData{Batch: tb})
	}
	mrr := pc.ExecBatch(ctx, &batch)
	var tag pgconn.CommandTag
	results := 0
	for mrr.NextResult() {
		t, rerr := mrr.ResultReader().Close()
		if tb != nil && results < 2 {
			tx.tracer.TraceBatchQuery(ctx, tx.pc, pgx.TraceBatchQueryData{SQL: tb.QueuedQueries[results].SQL, Args: tb.QueuedQueries[results].Arguments, CommandTag: t, Err: rerr})
		}
		tag = t
		results++
	}
	err := mrr.Close()
	if tb != nil {
		tx.tracer.TraceBatchEnd(ctx, tx.pc, pgx.TraceBatchEndData{Err: err})
	}
	if named && statementInvalid(err) {
		// A statement of the handler dropped or invalidated ours: send
		// them unnamed on this connection from now on (the next attempt
		// succeeds; this one failed before COMMIT, nothing committed).
		st.forgetStmt(tx.guard.sql)
		st.forgetStmt("commit")
		st.guardUnnamed = true
	}
	if err == nil && results != 2 {
		err = errors.New("middleware: commit guard: " + strconv.Itoa(results) + " results for 2 statements")
	}
	return tag, err
}

// checkGuard is the error of the guard statement run on its own before
// COMMIT (pgx's own transaction, database/sql): errHandlerEndedBySQL when
// it failed with processedstore.GuardFailed, err otherwise.
func checkGuard(err error) error {
	if guardFailed(err) {
		return fmt.Errorf("%w (the commit guard found the claim's row written outside this transaction: %w)", errHandlerEndedBySQL, err)
	}
	return err
}

// claimSavepoint marks the attempt's transaction on MySQL and SQLite (see
// the top of this file).
const claimSavepoint = "idempotency_claim"

// releaseClaimSavepoint releases claimSavepoint before COMMIT. When the
// RELEASE fails on a connection that still answers (a probe statement in
// the same transaction succeeds), the savepoint is gone: a statement of
// the handler ended the claim's transaction (MySQL: 1305 SAVEPOINT does
// not exist; SQLite: no such savepoint), and errHandlerEndedBySQL is
// returned. When the probe fails too, the RELEASE's error is the
// connection's and is returned as it is.
func releaseClaimSavepoint(ctx context.Context, tx *sql.Tx) error {
	_, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT "+claimSavepoint)
	if err == nil || ctx.Err() != nil {
		return err
	}
	var one int
	if perr := tx.QueryRowContext(ctx, "SELECT 1").Scan(&one); perr != nil {
		return err
	}
	return fmt.Errorf("%w (RELEASE SAVEPOINT: %w)", errHandlerEndedBySQL, err)
}
