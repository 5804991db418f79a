package sqldb

import (
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Handle is what the public idempotency.DB carries: one database, through
// exactly one of Pgx or Std, and its dialect. Build a pgx one with
// PgxHandle.
type Handle struct {
	Dialect Dialect
	Pgx     *pgxpool.Pool
	Std     *sql.DB
	// mode is OwnMode(Pgx), read once.
	mode any
}

// PgxHandle is the handle of a pgx pool (PostgreSQL).
func PgxHandle(pool *pgxpool.Pool) *Handle {
	return &Handle{Dialect: PostgreSQL, Pgx: pool, mode: OwnMode(pool)}
}

// Querier runs the library's own statements on the handle's pool, each in
// autocommit; on pgx in OwnMode.
func (h *Handle) Querier() Querier {
	if h.Pgx != nil {
		return PgxIn(h.Pgx, h.mode)
	}
	return Std(h.Std)
}

// OwnMode is OwnMode of the handle's pgx pool (nil for database/sql).
func (h *Handle) OwnMode() any { return h.mode }

// Pool hands out dedicated connections of the handle's pool, whose
// statements are sent as Querier's are.
func (h *Handle) Pool() Pool {
	if h.Pgx != nil {
		return pgxPool{h.Pgx, h.mode}
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
