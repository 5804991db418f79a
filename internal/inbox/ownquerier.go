package inbox

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// What the pgx beginner's claims found of the pool's server sessions
// (pgxBeginner.session).
const (
	sessionUnknown int32 = iota
	sessionDirect
	sessionShared
)

// noteSession records what a claim's connection showed of its server
// session: its own (direct: the process ID the connection was given at
// startup is pg_backend_pid()) or another's (a pooler's BackendKeyData),
// which is final. Called on every prepared claim: it writes only a change.
func (b *pgxBeginner) noteSession(direct bool) {
	switch s := b.session.Load(); {
	case !direct && s != sessionShared:
		b.session.Store(sessionShared)
	case direct && s == sessionUnknown:
		b.session.CompareAndSwap(sessionUnknown, sessionDirect)
	}
}

// OwnQuerier returns the querier of the library's own statements outside
// an attempt on b's pool (the crash count: a redelivered duplicate's
// only statement), given q, the same pool in a mode that needs no
// statement kept on a server session (sqldb.OwnMode: QueryExecModeExec,
// a parse and plan on the server each time). Where the pool's server
// sessions are its connections' own (a direct connection, no pooler),
// as its first statement finds (probeSession, one round trip per pool)
// and as long as no claim finds otherwise (the session lock timeout's
// check), statements go in the pool's own mode instead (pgx's default
// prepares each once per connection: about a third of the server
// instructions of a redelivered duplicate, bench part 6). Behind a
// pooler, while the probe fails, and for any other beginner it is q.
func OwnQuerier(b TxBeginner, q sqldb.Querier) sqldb.Querier {
	pb, ok := b.(*pgxBeginner)
	if !ok {
		return q
	}
	return ownQuerier{b: pb, direct: sqldb.Pgx(pb.pool), other: q}
}

type ownQuerier struct {
	b             *pgxBeginner
	direct, other sqldb.Querier
}

func (o ownQuerier) pick(ctx context.Context) sqldb.Querier {
	if o.b.session.Load() == sessionUnknown {
		o.b.probeSession(ctx)
	}
	if o.b.session.Load() == sessionDirect && !o.b.pooled.Load() {
		return o.direct
	}
	return o.other
}

// Exec and QueryRow send a statement that failed as prepared because its
// prepared statement is gone or stale (statementInvalid: other code on
// the pool ran DEALLOCATE ALL or DISCARD ALL, which pgx's statement cache
// does not see) once more unnamed: the server ran nothing of it, and pgx
// prepares it again next time.
func (o ownQuerier) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	q := o.pick(ctx)
	n, err := q.Exec(ctx, query, args...)
	if q == o.direct && statementInvalid(err) {
		return o.other.Exec(ctx, query, args...)
	}
	return n, err
}

func (o ownQuerier) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	q := o.pick(ctx)
	if q != o.direct {
		return q.QueryRow(ctx, query, args...)
	}
	return ownRow{o: o, ctx: ctx, query: query, args: args}
}

// ownRow is a row of ownQuerier read as prepared, read again unnamed when
// its statement was invalid.
type ownRow struct {
	o     ownQuerier
	ctx   context.Context
	query string
	args  []any
}

func (r ownRow) Scan(dest ...any) error {
	err := r.o.direct.QueryRow(r.ctx, r.query, r.args...).Scan(dest...)
	if statementInvalid(err) {
		return r.o.other.QueryRow(r.ctx, r.query, r.args...).Scan(dest...)
	}
	return err
}

// probeSession compares, on one of the pool's connections, the server
// process's ID with the one the connection was given at startup (a pooler
// gives its own: PgBouncer in any pool mode) and records the answer
// (noteSession). An error leaves the session unknown, to be probed again
// by the next statement; the statement itself then meets the same fault.
// One probe at a time: the others go on as unknown meanwhile.
func (b *pgxBeginner) probeSession(ctx context.Context) {
	if !b.probing.CompareAndSwap(false, true) {
		return
	}
	defer b.probing.Store(false)
	c, err := b.pool.Acquire(ctx)
	if err != nil {
		return
	}
	defer c.Release()
	var pid int64
	if err := c.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&pid); err != nil {
		return
	}
	b.noteSession(pid == int64(c.Conn().PgConn().PID()))
}
