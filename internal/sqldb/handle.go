package sqldb

import (
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Handle is what the public idempotency.DB carries: one database, through
// exactly one of Pgx or Std, and its dialect.
type Handle struct {
	Dialect Dialect
	Pgx     *pgxpool.Pool
	Std     *sql.DB
}

// Querier runs statements on the handle's pool, each in autocommit.
func (h *Handle) Querier() Querier {
	if h.Pgx != nil {
		return Pgx(h.Pgx)
	}
	return Std(h.Std)
}

// Pool hands out dedicated connections of the handle's pool.
func (h *Handle) Pool() Pool {
	if h.Pgx != nil {
		return PgxPool(h.Pgx)
	}
	return StdPool(h.Std)
}

// ErrNoDB is the error of a configuration whose DB field is the zero value.
var ErrNoDB = errors.New("no database handle (use idempotency.Pgx(pool) or idempotency.SQL(db, dialect))")

var unwrap func(any) *Handle

// SetUnwrap is called once, by the root package's init, with the function
// that opens its sealed DB value.
func SetUnwrap(f func(any) *Handle) { unwrap = f }

// HandleOf returns the handle inside an idempotency.DB, or ErrNoDB for the
// zero value.
func HandleOf(db any) (*Handle, error) {
	if unwrap == nil {
		return nil, ErrNoDB
	}
	h := unwrap(db)
	if h == nil || (h.Pgx == nil && h.Std == nil) {
		return nil, ErrNoDB
	}
	return h, nil
}
