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

var (
	unwrap   func(any) *Handle
	unwrapTx func(any) Querier
	wrapTx   func(Querier) any
)

// SetUnwrap is called once, by the root package's init, with the functions
// that open its sealed DB and Tx values and build a Tx.
func SetUnwrap(db func(any) *Handle, tx func(any) Querier, wrap func(Querier) any) {
	unwrap, unwrapTx, wrapTx = db, tx, wrap
}

// ErrNoTx is the error of a zero idempotency.Tx.
var ErrNoTx = errors.New("no transaction (use idempotency.PgxTx(tx) or idempotency.SQLTx(tx))")

// TxOf returns the querier inside an idempotency.Tx, or ErrNoTx.
func TxOf(tx any) (Querier, error) {
	if unwrapTx == nil {
		return nil, ErrNoTx
	}
	if q := unwrapTx(tx); q != nil {
		return q, nil
	}
	return nil, ErrNoTx
}

// WrapTx returns q as an idempotency.Tx (an any holding it).
func WrapTx(q Querier) any { return wrapTx(q) }

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
