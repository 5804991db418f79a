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

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
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
	// marked: the claim marked its transaction (processedstore.ClaimParams.Marked):
	// the guard's statement is sent only when the marker is gone.
	marked bool
	// session is the connection's prepared-claim state (nil: not the
	// prepared path): a handler statement that may change the session's
	// lock_timeout makes the next claim set it again (sessionChanged).
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
// Either way the attempt fails with errHandlerEndedBySQL. After a marked
// claim (tx.marked) whose marker the server still reports (claimOpen), the
// transaction is the claim's and COMMIT is sent alone.
func (tx *pgxTx) commit(ctx context.Context) error {
	if !tx.closed && tx.savepoint == "" && tx.pc.PgConn().TxStatus() == 'I' {
		tx.closed = true
		return errHandlerEndedBySQL
	}
	if tx.closed || tx.savepoint != "" || tx.guard.sql == "" {
		return tx.Commit(ctx)
	}
	if !tx.claimOpen() {
		return tx.commitGuarded(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	pc := tx.pc.PgConn()
	if !processedstore.ClaimMarkerIs(pc.ParameterStatus(processedstore.ClaimMarkerParam)) {
		return nil // the mark's undo was reported at COMMIT: it was the claim's transaction
	}
	// No undo reported: the session's own default is now the mark's value
	// (a reload turned the server's default on while the transaction ran,
	// or the handler set it for the session), so the mark proved nothing.
	// The claim row tells whether this COMMIT was the claim's. A failed
	// read leaves the outcome unknown: an error, never an ack.
	found, err := tx.guard.store.Processed(ctx, sqldb.Pgx(tx.pc), tx.guard.consumer, tx.guard.eventID)
	if err != nil {
		return fmt.Errorf("middleware: read the claim after COMMIT: %w", err)
	}
	if !found {
		return errHandlerEndedBySQL
	}
	return nil
}

// claimOpen reports, without a round trip, that the connection is still
// inside the claim's transaction: the claim marked it and the server's
// last ParameterStatus for the mark's setting is still the mark (any end of
// the transaction undoes it, and the server reports that before its
// ReadyForQuery; processedstore.ClaimMarkerIs). A transaction aborted by a
// handler statement ('E') is not open: the guarded COMMIT reports it. When
// the mark is not seen for another reason (a handler that set the setting
// itself, a pooler that drops ParameterStatus), the guard's statement
// decides, as without a mark. A handler that ends the transaction and sets
// the mark again in its own (SET LOCAL default_transaction_read_only = on)
// passes for the claim's: a known limit (docs/guarantees.md).
func (tx *pgxTx) claimOpen() bool {
	pc := tx.pc.PgConn()
	return tx.marked && pc.TxStatus() == 'T' && processedstore.ClaimMarkerIs(pc.ParameterStatus(processedstore.ClaimMarkerParam))
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
	return &pgxTx{pc: tx.pc, savepoint: name, savepoints: tx.savepoints, session: tx.session, traced: tx.traced}, nil
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
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
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
		tx.sessionSQL(q.SQL)
	}
	return tx.pc.SendBatch(ctx, b)
}

// sessionSQL tells the connection's claim state about a handler
// statement (connClaim.sessionChanged).
func (tx *pgxTx) sessionSQL(sql string) {
	if tx.session != nil {
		tx.session.sessionChanged(sql)
	}
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
	tx.sessionSQL(sql)
	return tx.pc.Prepare(ctx, name, sql)
}

func (tx *pgxTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if tx.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	tx.sessionSQL(sql)
	return tx.pc.Exec(ctx, sql, arguments...)
}

func (tx *pgxTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	tx.sessionSQL(sql)
	return tx.pc.Query(ctx, sql, args...)
}

func (tx *pgxTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.closed {
		return errRow{err: pgx.ErrTxClosed}
	}
	tx.sessionSQL(sql)
	return tx.pc.QueryRow(ctx, sql, args...)
}

// Conn returns the underlying connection.
func (tx *pgxTx) Conn() *pgx.Conn { return tx.pc }

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
