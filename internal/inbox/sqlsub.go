package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// ErrNoSubscriberTx: NewSQLSubscriberBeginner found no watermill-sql
// subscriber transaction in the message context (the handler does not
// consume from watermill-sql's Subscriber). A configuration error
// (ErrConfiguration): the delivery is held, never poisoned.
var ErrNoSubscriberTx = errors.New("idempotency: no watermill-sql subscriber transaction in the message context")

// savepointName is the savepoint of one message inside the subscriber's tx.
const savepointName = "idempotency_msg"

// NewSQLSubscriberBeginner returns the TxBeginner for messages consumed with
// watermill-sql v4's Subscriber (PostgreSQL or MySQL used as the queue): it
// joins the subscriber's transaction (wsql.TxFromContext) instead of opening
// its own, so the claim, the effects and the subscriber's offset commit
// together.
//
// That subscriber runs a whole batch of messages in one transaction and, on a
// nack, resends the message in the same transaction without rolling back.
// So each message runs inside a SAVEPOINT: a failed attempt rolls back to it
// (claim and effects vanish, and on PostgreSQL an aborted transaction becomes
// usable again) and a successful one releases it. On PostgreSQL an attempt
// that claimed its event keeps a row in <table>_running until it ends
// (savepointTx.running): the subscriber's COMMIT of its batch while the
// attempt runs (AckDeadline, Close) fails, and takes none of it. The Store's dialect must be
// the subscriber's database. The handler reads the transaction with
// QuerierFromContext, and also PgxTxFromContext or SQLTxFromContext depending
// on the subscriber's Beginner; it must not Commit or Rollback it.
//
// On PostgreSQL use watermill-sql's queue schema
// (wsql.PostgreSQLQueueSchema with wsql.PostgreSQLQueueOffsetsAdapter), or
// a schema of your own that reads committed rows whatever else is open:
// wsql.DefaultPostgreSQLSchema reads only rows below
// pg_snapshot_xmin(pg_current_snapshot()) (ThreeDotsLabs/watermill#311), so
// one session idle in a transaction anywhere on the server stops delivery
// until it ends.
func NewSQLSubscriberBeginner() TxBeginner { return sqlSubscriberBeginner{} }

type sqlSubscriberBeginner struct{}

func (sqlSubscriberBeginner) beginClaim(ctx context.Context, c claimRequest) (attemptTx, bool, error) {
	tx, ok := wsql.TxFromContext(ctx)
	if !ok {
		return nil, false, &ConfigurationError{Hint: "consume from watermill-sql's Subscriber, or unset ConsumerConfig.JoinSQLSubscriber to begin each attempt's transaction on ConsumerConfig.DB", Err: ErrNoSubscriberTx}
	}
	if err := ctx.Err(); err != nil {
		return nil, false, subscriberGaveUp(ctx)
	}
	a := &savepointTx{tx: tx, q: wsqlQuerier{tx}, claim: c, msgCtx: ctx}
	if _, err := tx.ExecContext(ctx, "SAVEPOINT "+savepointName); err != nil {
		return nil, false, fmt.Errorf("savepoint: %w", err)
	}
	if q, args, ok := c.lockTimeoutQuery(); ok {
		if _, err := a.q.Exec(ctx, q, args...); err != nil {
			_ = a.rollback(ctx)
			return nil, false, err
		}
	}
	claimed, err := c.claim(ctx, a.q)
	if err == nil && claimed {
		a.claimed = true
		a.running, err = c.store.StartRunning(ctx, a.q)
	}
	if err != nil {
		_ = a.rollback(ctx)
		return nil, false, err
	}
	return a, claimed, nil
}

// savepointTx is one message's part of the subscriber's transaction.
type savepointTx struct {
	tx   wsql.Tx
	q    sqldb.Querier
	done bool
	// claim is the attempt's claim; claimed: it inserted its row.
	claim   claimRequest
	claimed bool
	// msgCtx is the message's context, which watermill-sql ends when it
	// gives the message up (AckDeadline, Close) and goes on to end its
	// transaction: from then on the attempt sends nothing more on it (a
	// statement of ours beside the subscriber's COMMIT would share a
	// connection between two goroutines).
	msgCtx context.Context
	// running is the attempt's row in <table>_running, written after a
	// claim that inserted its row (0: none, a duplicate): its deferred
	// foreign key fails any COMMIT of the subscriber's transaction until
	// commit deletes it. watermill-sql commits its batch when a message
	// outlives the subscriber's AckDeadline or the subscriber closes,
	// while the attempt may still run; without the row that commit took
	// the claim and the effects written so far, and the rest was lost.
	running int64
}

func (a *savepointTx) parts() (sqldb.Querier, pgx.Tx, *sql.Tx) {
	switch t := a.tx.(type) {
	case *wsql.PgxTx:
		return a.q, t.Tx, nil
	case wsql.PgxTx:
		return a.q, t.Tx, nil
	case *wsql.StdSQLTx:
		return a.q, nil, t.Tx
	}
	return a.q, nil, nil
}

func (a *savepointTx) bind(ctx context.Context) context.Context {
	switch t := a.tx.(type) {
	case *wsql.PgxTx:
		ctx = context.WithValue(ctx, pgxTxKey{}, t.Tx)
	case wsql.PgxTx:
		ctx = context.WithValue(ctx, pgxTxKey{}, t.Tx)
	case *wsql.StdSQLTx:
		ctx = context.WithValue(ctx, sqlTxKey{}, t.Tx)
	}
	return sqldb.ContextWithTx(ctx, a.q)
}

// commit deletes the attempt's running row and releases the savepoint.
// The row gone means the handler ended the transaction or rolled back to
// the savepoint (ROLLBACK, ROLLBACK TO SAVEPOINT, or a COMMIT, which the
// row made fail): the claim is not part of the transaction any more, and
// the attempt fails with errHandlerEndedBySQL. A RELEASE that fails (on
// PostgreSQL 25P02 when a handler statement failed and the handler
// returned nil) leaves the savepoint open, so that the middleware's
// rollback rolls back to it: only this message's claim and effects
// vanish, and the subscriber's transaction is usable again for the
// batch's other messages.
func (a *savepointTx) commit(ctx context.Context) error {
	if a.done {
		return errors.New("idempotency: savepoint already ended")
	}
	if a.msgCtx.Err() != nil {
		a.done = true
		return subscriberGaveUp(a.msgCtx)
	}
	switch {
	case a.running != 0:
		if there, err := a.claim.store.EndRunning(ctx, a.q, a.running); err != nil {
			return err
		} else if !there {
			return errHandlerEndedBySQL
		}
	case a.claimed:
		// MySQL (no running row): the claim must still be part of the
		// transaction; a handler's ROLLBACK TO SAVEPOINT undid it.
		if ok, err := a.claim.store.Processed(ctx, a.q, a.claim.consumer, a.claim.eventID); err != nil {
			return err
		} else if !ok {
			return errHandlerEndedBySQL
		}
	}
	if _, err := a.tx.ExecContext(ctx, "RELEASE SAVEPOINT "+savepointName); err != nil {
		return err
	}
	a.done = true
	return nil
}

// subscriberGaveUp is the error of an attempt whose message watermill-sql
// gave up (its context ended: AckDeadline, Close): transient, the
// subscriber delivers the message again from its transaction's start.
func subscriberGaveUp(msgCtx context.Context) error {
	return &InfrastructureError{Op: "watermill-sql's subscriber gave the message up (AckDeadline passed, or it closed) and ends its transaction without the attempt", Err: context.Cause(msgCtx)}
}

// endedByHandler reports whether the attempt's running row is gone (see
// commit) on a transaction that still answers.
func (a *savepointTx) endedByHandler(ctx context.Context) bool {
	if a.running == 0 || a.done {
		return false
	}
	there, err := a.claim.store.Running(ctx, a.q, a.running)
	return err == nil && !there
}

func (a *savepointTx) rollback(ctx context.Context) error {
	if a.done {
		return nil
	}
	a.done = true // one try: a failed ROLLBACK TO leaves the subscriber's tx to fail its commit
	if a.msgCtx.Err() != nil {
		// The subscriber ends its transaction: its COMMIT fails on the
		// running row, or its ROLLBACK takes the attempt with it.
		return nil
	}
	if _, err := a.tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return err
	}
	_, err := a.tx.ExecContext(ctx, "RELEASE SAVEPOINT "+savepointName)
	return err
}

// release is a no-op: the subscriber owns the transaction and its connection.
func (a *savepointTx) release() {}

func (a *savepointTx) outboxExec() wsql.ContextExecutor { return a.tx }

// wsqlQuerier adapts watermill-sql's ContextExecutor to sqldb.Querier.
type wsqlQuerier struct{ e wsql.ContextExecutor }

func (w wsqlQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := w.e.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (w wsqlQuerier) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	rows, err := w.e.QueryContext(ctx, query, args...)
	return wsqlRow{rows: rows, err: err}
}

type wsqlRow struct {
	rows wsql.Rows
	err  error
}

func (r wsqlRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if e, ok := r.rows.(interface{ Err() error }); ok && e.Err() != nil {
			return e.Err()
		}
		return sqldb.ErrNoRows
	}
	return r.rows.Scan(dest...)
}
