package inbox

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Faults injects failures into one attempt, for idempotencytest.Explore:
// it is read from the message context when the attempt begins and costs
// nothing when absent.
type Faults interface {
	// Statement is called before (after false) and after (after true) each
	// statement the handler sends on the attempt's pgx transaction; an
	// error fails that statement. ErrFaultConnLost closes the connection
	// first.
	Statement(ctx context.Context, sql string, after bool) error
	// BeforeCommit is called once the handler returned nil, before the
	// commit; an error fails the attempt.
	BeforeCommit() error
}

// ErrFaultConnLost, returned by a Faults hook, closes the attempt's
// connection before the statement runs (a lost connection).
var ErrFaultConnLost = errors.New("idempotencytest: connection closed by fault injection")

type faultsKey struct{}

// faultsUsed is set by the process's first WithFaults: until then no
// context carries faults, and an attempt does not walk its context's
// chain to look for them.
var faultsUsed atomic.Bool

// WithFaults returns ctx carrying f for the attempts of the message.
func WithFaults(ctx context.Context, f Faults) context.Context {
	faultsUsed.Store(true)
	return context.WithValue(ctx, faultsKey{}, f)
}

func faultsFrom(ctx context.Context) Faults {
	if !faultsUsed.Load() {
		return nil
	}
	f, _ := ctx.Value(faultsKey{}).(Faults)
	return f
}

// injectFaults wraps the handler's pgx transaction with f's hooks.
func (st *attemptState) injectFaults(f Faults) {
	if st.ptx == nil {
		return
	}
	st.ptx = &faultTx{Tx: st.ptx, f: f}
	st.q = sqldb.Pgx(st.ptx)
}

// faultTx is the handler's pgx.Tx with fault hooks around its statements:
// Exec, Query, QueryRow, SendBatch and CopyFrom, and a savepoint's
// SAVEPOINT, whose statements are hooked too. Its RELEASE and ROLLBACK TO
// are not points: the server ends the transaction when one fails, which
// an error injected before it, the transaction left healthy, would not
// stand for. What the handler sends through Conn is not hooked: f hears
// of it (Unhooked).
type faultTx struct {
	pgx.Tx
	f Faults
}

// Unhooked is implemented by a Faults that wants to know when the handler
// sends statements its hooks cannot see (through what, e.g. "tx.Conn()").
type Unhooked interface{ Unhooked(what string) }

func (t *faultTx) hook(ctx context.Context, sql string, after bool) error {
	err := t.f.Statement(ctx, sql, after)
	if errors.Is(err, ErrFaultConnLost) {
		_ = t.Tx.Conn().Close(context.WithoutCancel(ctx))
	}
	return err
}

func (t *faultTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.hook(ctx, sql, false); err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := t.Tx.Exec(ctx, sql, args...)
	if err != nil {
		return tag, err
	}
	return tag, t.hook(ctx, sql, true)
}

func (t *faultTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.hook(ctx, sql, false); err != nil {
		return nil, err
	}
	rows, err := t.Tx.Query(ctx, sql, args...)
	if err != nil {
		return rows, err
	}
	if err := t.hook(ctx, sql, true); err != nil {
		rows.Close()
		return nil, err
	}
	return rows, nil
}

func (t *faultTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.hook(ctx, sql, false); err != nil {
		return errRow{err: err}
	}
	return faultRow{t.Tx.QueryRow(ctx, sql, args...), func() error { return t.hook(ctx, sql, true) }}
}

type faultRow struct {
	pgx.Row
	after func() error
}

func (r faultRow) Scan(dest ...any) error {
	if err := r.Row.Scan(dest...); err != nil {
		return err
	}
	return r.after()
}

// SendBatch is one point: the batch's statements, before it is sent and
// after its results are closed.
func (t *faultTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	var sqls []string
	for _, q := range b.QueuedQueries {
		sqls = append(sqls, q.SQL)
	}
	text := strings.Join(sqls, "; ")
	if err := t.hook(ctx, text, false); err != nil {
		return errBatch{err: err}
	}
	return &faultBatch{BatchResults: t.Tx.SendBatch(ctx, b), after: func() error { return t.hook(ctx, text, true) }}
}

type faultBatch struct {
	pgx.BatchResults
	after func() error
}

func (r *faultBatch) Close() error {
	if err := r.BatchResults.Close(); err != nil {
		return err
	}
	return r.after()
}

// errBatch is the results of a batch a fault refused.
type errBatch struct {
	pgx.BatchResults
	err error
}

func (e errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, e.err }
func (e errBatch) Query() (pgx.Rows, error)         { return nil, e.err }
func (e errBatch) QueryRow() pgx.Row                { return errRow{err: e.err} }
func (e errBatch) Close() error                     { return e.err }

// around runs op between the hooks of the statement sql.
func (t *faultTx) around(ctx context.Context, sql string, op func() error) error {
	if err := t.hook(ctx, sql, false); err != nil {
		return err
	}
	if err := op(); err != nil {
		return err
	}
	return t.hook(ctx, sql, true)
}

// Begin opens a savepoint (a statement point) whose statements are hooked.
func (t *faultTx) Begin(ctx context.Context) (pgx.Tx, error) {
	var sp pgx.Tx
	err := t.around(ctx, "SAVEPOINT", func() (err error) {
		sp, err = t.Tx.Begin(ctx)
		return err
	})
	if err != nil {
		if sp != nil {
			_ = sp.Rollback(ctx)
		}
		return nil, err
	}
	return &faultTx{Tx: sp, f: t.f}, nil
}

func (t *faultTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	var n int64
	err := t.around(ctx, "COPY "+tableName.Sanitize()+" FROM STDIN", func() (err error) {
		n, err = t.Tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
		return err
	})
	return n, err
}

// Conn is the connection: what the handler sends there is not hooked.
func (t *faultTx) Conn() *pgx.Conn {
	if u, ok := t.f.(Unhooked); ok {
		u.Unhooked("tx.Conn()")
	}
	return t.Tx.Conn()
}
