package sqldb

import "context"

type txKey struct{}

// ContextWithTx returns ctx carrying q as the transaction the caller's work
// runs in (the idempotent middleware binds each attempt's transaction with
// it). Library code that must not open a conflicting transaction of its own
// reads it with TxFromContext: operation.Runner refuses, on SQLite, to write
// to the database file of the caller's transaction.
func ContextWithTx(ctx context.Context, q Querier) context.Context {
	return context.WithValue(ctx, txKey{}, q)
}

// TxFromContext returns the transaction ContextWithTx put in ctx; ok is false
// when there is none. It never panics.
func TxFromContext(ctx context.Context) (q Querier, ok bool) {
	q, ok = ctx.Value(txKey{}).(Querier)
	return q, ok
}
