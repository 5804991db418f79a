package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// pgxTx is the pgx.Tx the pipelined beginner hands to handlers. BEGIN was
// sent in the same batch as the claim, so the transaction lives on the server
// and this type only delegates statements to the acquired connection.
//
// Contract, as pgx's own transaction type:
//   - Commit sends COMMIT and succeeds only when the server answers COMMIT;
//     the ROLLBACK tag (a statement failed inside the transaction) is
//     pgx.ErrTxCommitRollback. Commit or Rollback on a closed tx returns
//     pgx.ErrTxClosed; Rollback after Commit is therefore safe.
//   - Begin opens a savepoint ("pseudo nested transaction"): its Commit
//     releases the savepoint, its Rollback rolls back to it. Every savepoint
//     of one transaction has a name of its own (a counter kept by the root,
//     as pgx's own transaction type does), so two siblings never share one.
//   - LargeObjects: pgx.LargeObjects has no exported constructor, so the first
//     call sends pgx's own BEGIN on the connection to obtain one. PostgreSQL
//     answers with a WARNING (25001, a transaction is already in progress)
//     and stays in our transaction; the large objects then work inside it.
//     It costs one extra round trip per call; the returned value is valid
//     until this transaction ends.
//   - A handler should not Commit or Rollback the middleware's transaction:
//     the middleware's own commit then fails with pgx.ErrTxClosed and the
//     attempt is permanent (handler_ended_tx; it never acks an attempt
//     whose end it did not see). So is one that ends it by SQL (commit).
type pgxTx struct {
	// Tx is always nil. It is embedded so that a method a newer pgx adds to
	// pgx.Tx is promoted (and panics if called) instead of breaking the
	// build of every user who upgrades pgx; every method of the pgx.Tx we
	// build against is implemented below (TestPgxImplementationsAreExplicit).
	pgx.Tx

	conn *pgxpool.Conn // nil for savepoints (the root owns the connection)
	pc   *pgx.Conn

	savepoint string // "" for the root transaction
	// savepoints counts the savepoints opened on the root transaction,
	// shared by all of them: each gets a name of its own, so siblings are
	// distinct and rolling back one never undoes another.
	savepoints *int
	spCount    int // the root's counter (savepoints points here)
	closed     bool
	// prepared: the claim was sent as the beginner's prepared statements
	// (pgxclaim.go); the duplicate's read and ROLLBACK are sent so too.
	prepared bool
	// tracer is the pool's pgx.BatchTracer (nil: none), for the batches
	// this type sends through pgconn.
	tracer pgx.BatchTracer
	// pooled is the beginner's pooler flag (pgxBeginner.pooled): the
	// duplicate's read is sent unnamed once it is set.
	pooled *atomic.Bool
	// guard is the commit guard of a claimed attempt (commitguard.go).
	guard commitGuard
	// pinned: a prepared lean claim on a qualified table claimed the row
	// (processedstore.ClaimParams.Pinned): the guard's statement is sent
	// only when a handler statement may have ended the transaction
	// (txscan.go).
	pinned bool
	// state is the attempt's state when this is its root transaction
	// (stateOf): one allocation for both.
	state attemptState
	// scan is the root's scanV, shared by its savepoints: whether a
	// handler statement may have ended the transaction.
	scan  *txScan
	scanV txScan
	// session is the connection's claim state (pgxclaim.go): a handler
	// statement that may change the session's lock_timeout makes the next
	// prepared claim set it again, and what the handler does on the
	// connection itself marks it raw (handlerStatement).
	session *connClaim
	// traced: the pool has a pgx tracer, which sees only what goes
	// through pgx.Conn (endTx then sends through it).
	traced bool
}

var _ pgx.Tx = (*pgxTx)(nil)

func (tx *pgxTx) bind(ctx context.Context) context.Context {
	ctx = context.WithValue(ctx, pgxTxKey{}, pgx.Tx(tx))
	return sqldb.ContextWithTx(ctx, sqldb.Pgx(tx))
}

// commit commits the attempt. The connection must still be inside the
// transaction that BEGIN opened, and it must be the claim's:
//   - a handler statement that ended it (ROLLBACK, COMMIT, END, ABORT
//     through Exec) leaves the connection idle ('I', read from the last
//     ReadyForQuery: no round trip), and a COMMIT then would only warn;
//   - one that ended it and began another (ROLLBACK or COMMIT then BEGIN,
//     COMMIT AND CHAIN) leaves it in a transaction without the claim, or
//     whose claim is already committed: the guard statement sent with
//     COMMIT in one batch fails and COMMIT does not commit
//     (commitGuarded).
//
// Either way the attempt fails with errHandlerEndedBySQL. After a pinned
// claim whose handler statements all kept the transaction (claimKept,
// txscan.go), COMMIT is sent alone.
func (tx *pgxTx) commit(ctx context.Context) error {
	if !tx.closed && tx.savepoint == "" && tx.pc.PgConn().TxStatus() == 'I' {
		tx.closed = true
		return errHandlerEndedBySQL
	}
	if tx.closed || tx.savepoint != "" || tx.guard.sql == "" || tx.claimKept() {
		return tx.Commit(ctx)
	}
	return tx.commitGuarded(ctx)
}

// claimKept reports, without a round trip, that the connection is still
// inside the claim's transaction: the claim is pinned, no handler
// statement could have ended the transaction (txscan.go), the handler
// never reached the connection itself, and the last ReadyForQuery said
// "in a transaction" ('T'; an aborted one, 'E', goes through the guarded
// COMMIT, which reports it).
func (tx *pgxTx) claimKept() bool {
	return tx.pinned && !tx.scan.mayEnd && !tx.session.raw && tx.pc.PgConn().TxStatus() == 'T'
}

func (tx *pgxTx) rollback(ctx context.Context) error {
	err := tx.Rollback(ctx)
	if errors.Is(err, pgx.ErrTxClosed) {
		return nil
	}
	return err
}

// release returns the connection to the pool. pgxpool destroys a connection
// that is closed, busy or still inside a transaction instead of reusing it.
func (tx *pgxTx) release() {
	if tx.conn != nil {
		tx.conn.Release()
		tx.conn = nil
	}
}

func (tx *pgxTx) outboxExec() wsql.ContextExecutor { return wsql.TxFromPgx(tx) }

func (tx *pgxTx) parts() (sqldb.Querier, pgx.Tx, *sql.Tx) { return nil, tx, nil }

// readAndRollback ends the transaction of a claim that inserted nothing (a
// duplicate, or an event refused by the replay window) in one round trip:
// query (the stored identity's read, processed.Store.StoredIdentityQuery)
// and ROLLBACK sent together in one batch. found is false when query
// returned no row. The read is a statement of its own after the claim, so
// under READ COMMITTED it takes a new snapshot and sees a row that a
// concurrent claim committed while this one waited on it. The transaction
// is closed afterwards whatever happened: a read that failed leaves it
// aborted and skips the ROLLBACK (one Sync ends the batch), so ROLLBACK is
// sent on its own; a connection whose ROLLBACK failed is closed, as by
// Rollback. After it, afterEnd runs statements on the connection in
// autocommit mode (the replay window's verdict) until release.
//
// After a prepared claim (tx.prepared) the read and the ROLLBACK are
// statements prepared once per connection too, sent in one pgconn.Batch
// with key encoded as the claim's parameters (readAndRollbackPrepared).
func (tx *pgxTx) readAndRollback(ctx context.Context, query string, args []any, key identityKey, name, fp *[]byte) (found bool, err error) {
	if tx.closed {
		return false, pgx.ErrTxClosed
	}
	if tx.prepared {
		found, err = tx.readAndRollbackPrepared(ctx, query, key, name, fp)
		if err != errFallback {
			return found, err
		}
	}
	tx.closed = true
	b := &pgx.Batch{}
	b.Queue(query, args...)
	b.Queue("rollback")
	br := tx.pc.SendBatch(ctx, b)
	err = br.QueryRow().Scan(name, fp)
	found = err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	_, rbErr := br.Exec()
	closeErr := br.Close()
	if err == nil {
		err = rbErr
	}
	if err == nil {
		err = closeErr
	}
	err = tx.endAfterBatch(ctx, err)
	if statementInvalid(err) && !tx.pc.IsClosed() && tx.pc.PgConn().TxStatus() == 'I' {
		// pgx's cached statement was lost (26000) or its plan no longer
		// fits the table (0A000); pgx dropped it from its cache. Read
		// once more, after the transaction, without a named statement.
		err = tx.pc.QueryRow(ctx, query, append([]any{pgx.QueryExecModeExec}, args...)...).Scan(name, fp)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	return found, err
}

// endAfterBatch makes sure the transaction ended after a batch that ended
// in ROLLBACK: a failed statement before it (one Sync: the ROLLBACK was
// skipped) leaves it aborted, so ROLLBACK is sent on its own; a connection
// whose ROLLBACK failed is closed. It returns err, or the ROLLBACK's error.
func (tx *pgxTx) endAfterBatch(ctx context.Context, err error) error {
	if tx.pc.PgConn().TxStatus() != 'I' {
		if _, rerr := tx.pc.Exec(ctx, "rollback"); rerr != nil {
			_ = tx.pc.Close(context.WithoutCancel(ctx))
			if err == nil {
				err = rerr
			}
		}
	}
	return err
}

// afterEnd is the connection in autocommit mode, for statements after
// readAndRollback ended the transaction.
func (tx *pgxTx) afterEnd() sqldb.Querier { return sqldb.Pgx(tx.pc) }

// Begin starts a savepoint inside the transaction.
func (tx *pgxTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	*tx.savepoints++
	name := "idempotency_sp_" + strconv.Itoa(*tx.savepoints)
	if _, err := tx.pc.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &pgxTx{pc: tx.pc, savepoint: name, savepoints: tx.savepoints, session: tx.session, scan: tx.scan, traced: tx.traced}, nil
}

// Commit commits the transaction, or releases the savepoint.
func (tx *pgxTx) Commit(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	tx.closed = true
	if tx.savepoint != "" {
		_, err := tx.pc.Exec(ctx, "release savepoint "+tx.savepoint)
		return err
	}
	tag, err := tx.endTx(ctx, "commit")
	if err != nil {
		if tx.pc.PgConn().TxStatus() != 'I' {
			// Unknown state: never reuse the connection.
			_ = tx.pc.Close(context.WithoutCancel(ctx))
		}
		return err
	}
	switch tag.String() {
	case "COMMIT":
		return nil
	case "ROLLBACK":
		return pgx.ErrTxCommitRollback
	}
	return errNotCommitted(ctx, tx, tag)
}

// errNotCommitted is the error of a COMMIT answered by another statement's
// tag: pgx.Conn runs a statement prepared under the name "commit" (a
// handler's Prepare) in its place, and the transaction stays open. The
// connection is closed, so the server rolls it back, and the attempt
// fails: it is never acked uncommitted.
func errNotCommitted(ctx context.Context, tx *pgxTx, tag pgconn.CommandTag) error {
	_ = tx.pc.Close(context.WithoutCancel(ctx))
	return fmt.Errorf("middleware: COMMIT answered %q: a statement prepared under the name \"commit\" ran instead; the transaction was rolled back", tag.String())
}

// Rollback rolls the transaction back, or rolls back to the savepoint. A
// failed ROLLBACK closes the connection, so it is never reused mid-transaction.
func (tx *pgxTx) Rollback(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	tx.closed = true
	if tx.savepoint != "" {
		_, err := tx.pc.Exec(ctx, "rollback to savepoint "+tx.savepoint)
		return err
	}
	if _, err := tx.endTx(ctx, "rollback"); err != nil {
		_ = tx.pc.Close(context.WithoutCancel(ctx))
		return err
	}
	return nil
}

// endTx sends COMMIT or ROLLBACK (sql) in the simple protocol, as pgx's
// Conn.Exec does for a statement without arguments, but through pgconn:
// without pgx's statement-cache upkeep (a map allocated per Exec), one of
// the client's costs per message (issue 25). With a tracer on the pool,
// which sees only what goes through pgx.Conn, it is Conn.Exec.
func (tx *pgxTx) endTx(ctx context.Context, sql string) (pgconn.CommandTag, error) {
	if tx.traced {
		return tx.pc.Exec(ctx, sql)
	}
	mrr := tx.pc.PgConn().Exec(ctx, sql)
	var tag pgconn.CommandTag
	for mrr.NextResult() {
		tag, _ = mrr.ResultReader().Close()
	}
	return tag, mrr.Close()
}

func (tx *pgxTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if tx.closed {
		return 0, pgx.ErrTxClosed
	}
	return tx.pc.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (tx *pgxTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if tx.closed {
		return &closedBatchResults{}
	}
	for _, q := range b.QueuedQueries {
		tx.handlerSQL(q.SQL, q.Arguments)
		if fn := q.Fn; fn != nil {
			// A callback's rows reach the connection too (rowsConn).
			s := tx.session
			q.Fn = func(br pgx.BatchResults) error { return fn(batchConn{br, s}) }
		}
	}
	return batchConn{tx.pc.SendBatch(ctx, b), tx.session}
}

// rowsConn is a handler's pgx.Rows: pgx.Rows.Conn
// returns the connection as pgxTx.Conn does, so it taints the connection
// the same way (connClaim.raw): what the handler sends there is not
// scanned.
type rowsConn struct {
	pgx.Rows
	session *connClaim
}

func (r *rowsConn) Conn() *pgx.Conn {
	r.session.raw = true
	return r.Rows.Conn()
}

// batchConn is a handler's pgx.BatchResults: the rows it returns are
// rowsConn.
type batchConn struct {
	pgx.BatchResults
	session *connClaim
}

func (b batchConn) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	if rows != nil {
		rows = &rowsConn{rows, b.session}
	}
	return rows, err
}

// txScan is what the handler's statements told about the attempt's
// transaction (txscan.go).
type txScan struct {
	// mayEnd: a statement may have ended it, or pgx may have sent text
	// the scan did not see.
	mayEnd bool
}

// handlerSQL tells the connection's claim state about a handler
// statement and its arguments (connClaim.handlerStatement, scanArgs) and
// reports whether it may end the transaction.
func (tx *pgxTx) handlerSQL(sql string, args []any) bool {
	rewrites, sanitizes := scanArgs(args)
	if rewrites {
		// pgx hands the rewriter the connection: what it sends or
		// prepares there is not scanned, as after tx.Conn.
		tx.session.raw = true
	}
	if tx.session.handlerStatement(sql) || sanitizes {
		// What pgx writes into the text may be any SQL: one that ends
		// the transaction, or sets the session's lock timeout, which the
		// next claim then sets again.
		tx.session.lockMs = 0
		tx.scan.mayEnd = true
		return true
	}
	return false
}

// LargeObjects: see the type's documentation.
func (tx *pgxTx) LargeObjects() pgx.LargeObjects {
	inner, err := tx.pc.Begin(context.Background())
	if err != nil {
		return pgx.LargeObjects{}
	}
	return inner.LargeObjects()
}

func (tx *pgxTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	if tx.handlerSQL(sql, nil) {
		// Its name may be sent as a query string on a later attempt.
		tx.session.raw = true
	}
	return tx.pc.Prepare(ctx, name, sql)
}

func (tx *pgxTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if tx.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	tx.handlerSQL(sql, arguments)
	return tx.pc.Exec(ctx, sql, arguments...)
}

func (tx *pgxTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	tx.handlerSQL(sql, args)
	rows, err := tx.pc.Query(ctx, sql, args...)
	if rows != nil {
		rows = &rowsConn{rows, tx.session}
	}
	return rows, err
}

func (tx *pgxTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.closed {
		return errRow{err: pgx.ErrTxClosed}
	}
	tx.handlerSQL(sql, args)
	return tx.pc.QueryRow(ctx, sql, args...)
}

// Conn returns the underlying connection. What the handler sends on it
// is not scanned, so the attempt, and every later claimed attempt on this
// connection, commits with the guard's statement (txscan.go). So does
// the Conn of rows from Query or SendBatch (rowsConn).
func (tx *pgxTx) Conn() *pgx.Conn {
	tx.session.raw = true
	return tx.pc
}

// ownConn is the connection of the attempt's transaction t, for the
// library's own statements in it: pgxTx.Conn would mark the connection raw
// (what a handler sends there is unseen), so that every later attempt on
// it paid the commit guard's statement and the lock timeout's check.
func ownConn(t pgx.Tx) *pgx.Conn {
	if p, ok := t.(*pgxTx); ok {
		return p.pc
	}
	return t.Conn()
}

// errRow and closedBatchResults embed their (nil) pgx interface for the
// same reason as pgxTx: a method a newer pgx adds is promoted, the build
// does not break.
type errRow struct {
	pgx.Row
	err error
}

func (r errRow) Scan(...any) error { return r.err }

type closedBatchResults struct{ pgx.BatchResults }

func (closedBatchResults) Exec() (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, pgx.ErrTxClosed
}
func (closedBatchResults) Query() (pgx.Rows, error) { return nil, pgx.ErrTxClosed }
func (closedBatchResults) QueryRow() pgx.Row        { return errRow{err: pgx.ErrTxClosed} }
func (closedBatchResults) Close() error             { return pgx.ErrTxClosed }

// Tx is pgx.BatchResults.Tx (pgx ≥ v5.12): the batch of a closed
// transaction began no transaction.
func (closedBatchResults) Tx() pgx.Tx { return nil }

// statementsLost reports a 26000 (a prepared statement the session does not
// know) or 42P05 (a name the session already has) anywhere in err: the
// session's prepared statements changed under the client (a transaction
// pooler sharing server connections, DISCARD ALL).
func statementsLost(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && (pg.Code == "26000" || pg.Code == "42P05")
}

// resetStatements forgets, after a failed attempt on pgx, every statement
// prepared on the attempt's connection, in pgx's cache and on the server
// (DEALLOCATE ALL): behind a pooler that shares server connections, a
// handler statement that pgx caches under a name of its SQL (another
// client's statement of the same SQL already holds that name there) would
// otherwise fail the same way at every retry. The library's own claim
// statements are prepared again on the next attempt (26000, once).
func resetStatements(ctx context.Context, tx attemptTx) {
	p, ok := tx.(*pgxTx)
	if !ok || p.pc == nil || p.pc.IsClosed() {
		return
	}
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	_ = p.pc.DeallocateAll(c)
}

// stateSlot is the attempt's state in the root transaction's allocation.
func (tx *pgxTx) stateSlot() *attemptState { return &tx.state }
