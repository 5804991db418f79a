package sqldb

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Pool hands out dedicated connections, for work that needs one session:
// session-level advisory locks (the purger), or statements that must not
// share the caller's transaction (operation records).
type Pool interface {
	// Acquire returns a connection of the pool; Release it when done.
	Acquire(ctx context.Context) (Conn, error)
}

// Conn is one dedicated connection. Statements on it run in autocommit mode
// (each its own transaction) unless the caller sends BEGIN.
type Conn interface {
	Querier
	// Release returns the connection to its pool. Call it exactly once.
	Release()
}

// PgxPool adapts a pgxpool.Pool; statements on its connections are sent in
// OwnMode(p).
func PgxPool(p *pgxpool.Pool) Pool { return pgxPool{p, OwnMode(p)} }

// StdPool adapts a *sql.DB.
func StdPool(db *sql.DB) Pool { return stdPool{db} }

type pgxPool struct {
	p    *pgxpool.Pool
	mode any
}

func (p pgxPool) Acquire(ctx context.Context) (Conn, error) {
	c, err := p.p.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return pgxConn{PgxIn(c, p.mode), c}, nil
}

type pgxConn struct {
	Querier
	c *pgxpool.Conn
}

func (c pgxConn) Release() { c.c.Release() }

type stdPool struct{ db *sql.DB }

func (p stdPool) Acquire(ctx context.Context) (Conn, error) {
	c, err := p.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	return stdConn{stdQuerier{c}, c}, nil
}

type stdConn struct {
	stdQuerier
	c *sql.Conn
}

func (c stdConn) Release() { _ = c.c.Close() }
