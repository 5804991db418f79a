package inbox

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Unexported key types: no other package can read or overwrite these values.
type (
	pgxTxKey struct{}
	sqlTxKey struct{}
)

// PgxTxFromContext returns the attempt's transaction when the middleware runs
// on pgx (NewPgxBeginner). ok is false outside the middleware or on another
// driver; it never panics. Do not Commit or Rollback it: the middleware does,
// after the handler returns. A handler that ends it itself fails the
// attempt as permanent (reason "handler_ended_tx": poisoned once; when it
// committed, its effect stays applied but the messages it produced are not
// written). The transaction is valid only until the handler returns and,
// like pgx's own, not safe for concurrent use: a goroutine the handler
// starts must be done with it before the handler returns. Retry belongs
// outside the idempotent middleware (NewChain puts it there): a Retry
// inside it re-runs the handler in the same transaction, keeping the
// failed try's writes.
func PgxTxFromContext(ctx context.Context) (tx pgx.Tx, ok bool) {
	if st, ok := stateFrom(ctx); ok {
		return st.ptx, st.ptx != nil
	}
	tx, ok = ctx.Value(pgxTxKey{}).(pgx.Tx)
	return tx, ok
}

// SQLTxFromContext returns the attempt's transaction when the middleware runs
// on database/sql (NewStdBeginner). ok is false otherwise; it never panics.
// Do not Commit or Rollback it.
func SQLTxFromContext(ctx context.Context) (tx *sql.Tx, ok bool) {
	if st, ok := stateFrom(ctx); ok {
		return st.stx, st.stx != nil
	}
	tx, ok = ctx.Value(sqlTxKey{}).(*sql.Tx)
	return tx, ok
}

// QuerierFromContext returns the attempt's transaction as a driver-neutral
// sqldb.Querier, whichever driver the middleware runs on: what library
// helpers (versioned.Upsert.Apply, …) take. It is sqldb.TxFromContext.
func QuerierFromContext(ctx context.Context) (q sqldb.Querier, ok bool) {
	return sqldb.TxFromContext(ctx)
}
