package operation

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The Runner's driver seam: a pool of dedicated connections (one per Do,
// carrying the key's session lock) that can begin transactions and be
// thrown away, over pgx (pgxpool) or database/sql.

// connPool is where a Runner takes its connections; as a Querier it runs
// single statements on any connection (Get, the retried outcome writes).
type connPool interface {
	sqldb.Querier
	acquire(ctx context.Context) (conn, error)
	// describe names the pool and its use, for errors.
	describe() string
}

// conn is one dedicated connection: a database session.
type conn interface {
	sqldb.Querier
	begin(ctx context.Context) (tx, error)
	// release returns the connection to its pool, or, with discard, closes
	// it, which ends its session and every session lock it held.
	release(ctx context.Context, discard bool)
}

// tx is a transaction on a conn. Rollback after Commit is a no-op.
type tx interface {
	sqldb.Querier
	commit(ctx context.Context) error
	rollback(ctx context.Context) error
}

type pgxConnPool struct {
	sqldb.Querier
	p *pgxpool.Pool
}

func newPgxConnPool(p *pgxpool.Pool) connPool { return pgxConnPool{sqldb.Pgx(p), p} }

func (p pgxConnPool) acquire(ctx context.Context) (conn, error) {
	c, err := p.p.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return pgxConn{sqldb.Pgx(c), c}, nil
}

func (p pgxConnPool) describe() string {
	cc, st := p.p.Config().ConnConfig, p.p.Stat()
	return fmt.Sprintf("Config.Pool %s@%s:%d/%s, %d of %d connections acquired",
		cc.User, cc.Host, cc.Port, cc.Database, st.AcquiredConns(), st.MaxConns())
}

type pgxConn struct {
	sqldb.Querier
	c *pgxpool.Conn
}

func (c pgxConn) begin(ctx context.Context) (tx, error) {
	t, err := c.c.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return pgxTx{sqldb.Pgx(t), t}, nil
}

func (c pgxConn) release(ctx context.Context, discard bool) {
	if discard {
		_ = c.c.Conn().Close(ctx) // pgxpool then destroys it on Release
	}
	c.c.Release()
}

type pgxTx struct {
	sqldb.Querier
	t pgx.Tx
}

func (t pgxTx) commit(ctx context.Context) error   { return t.t.Commit(ctx) }
func (t pgxTx) rollback(ctx context.Context) error { return t.t.Rollback(ctx) }

type stdConnPool struct {
	sqldb.Querier
	db *sql.DB
}

func newStdConnPool(db *sql.DB) connPool { return stdConnPool{sqldb.Std(db), db} }

func (p stdConnPool) acquire(ctx context.Context) (conn, error) {
	c, err := p.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	return stdConn{sqldb.Std(c), c}, nil
}

func (p stdConnPool) describe() string {
	st := p.db.Stats()
	return fmt.Sprintf("Config.DB, %d of %d open connections in use (max %d)", st.InUse, st.OpenConnections, st.MaxOpenConnections)
}

type stdConn struct {
	sqldb.Querier
	c *sql.Conn
}

func (c stdConn) begin(ctx context.Context) (tx, error) {
	t, err := c.c.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	return stdTx{sqldb.Std(t), t}, nil
}

func (c stdConn) release(_ context.Context, discard bool) {
	if discard {
		// driver.ErrBadConn from Raw makes database/sql close the
		// connection instead of returning it to the pool.
		_ = c.c.Raw(func(any) error { return driver.ErrBadConn })
	}
	_ = c.c.Close()
}

type stdTx struct {
	sqldb.Querier
	t *sql.Tx
}

func (t stdTx) commit(context.Context) error { return t.t.Commit() }

func (t stdTx) rollback(context.Context) error {
	if err := t.t.Rollback(); err != sql.ErrTxDone {
		return err
	}
	return nil
}
