package sqldb

import (
	"context"
	"errors"
)

type txKey struct{}

// ContextWithTx returns ctx carrying q as the transaction the caller's work
// runs in (the idempotent middleware binds each attempt's transaction with
// it). Library code that must not open a conflicting transaction of its own
// reads it with TxFromContext: operation.Runner refuses, on SQLite, to write
// to the database file of the caller's transaction.
func ContextWithTx(ctx context.Context, q Querier) context.Context {
	return context.WithValue(ctx, txKey{}, q)
}

// TxContext is ContextWithTx as a value the caller places in memory it
// already allocated (the middleware's attempt state): Context carrying Tx
// under ContextWithTx's key, every other key and the deadline, Done and
// Err from Context. Use a pointer to it as the context.
type TxContext struct {
	context.Context
	Tx Querier
}

// Value returns Tx for TxFromContext's key and Context's value otherwise.
func (c *TxContext) Value(key any) any {
	if _, ok := key.(txKey); ok {
		return c.Tx
	}
	return c.Context.Value(key)
}

// TxFromContext returns the transaction ContextWithTx put in ctx; ok is false
// when there is none. It never panics.
func TxFromContext(ctx context.Context) (q Querier, ok bool) {
	q, ok = ctx.Value(txKey{}).(Querier)
	return q, ok
}

// ErrSharedSQLiteFile: on SQLite, one database file was given both to the
// idempotent middleware (the handlers' transactions) and to an
// operation.Runner (its records). SQLite has one writer per file, and the
// Runner commits its started record before the external call while the
// handler's transaction holds the file's write lock, so the two cannot share
// it. middleware.NewIdempotent and operation.NewRunner refuse the second of
// the two wirings in a process; operation.Runner.Do refuses a call inside a
// transaction on its own file. Give the Runner a database file of its own.
var ErrSharedSQLiteFile = errors.New("the SQLite database file of the operation runner is the one of the idempotent middleware's transactions")
