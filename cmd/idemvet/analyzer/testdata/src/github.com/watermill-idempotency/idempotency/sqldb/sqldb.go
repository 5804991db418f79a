// Package sqldb is a stub of github.com/watermill-idempotency/idempotency/sqldb.
package sqldb

import "context"

type Row interface{ Scan(dest ...any) error }

type Querier interface {
	Exec(ctx context.Context, query string, args ...any) (rowsAffected int64, err error)
	QueryRow(ctx context.Context, query string, args ...any) Row
}

func TxFromContext(ctx context.Context) (Querier, bool) { return nil, false }
