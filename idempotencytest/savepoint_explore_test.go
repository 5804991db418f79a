package idempotencytest_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// Correct handlers that use savepoints normally: Explore must report
// nothing.
func TestExploreFindsNothingInCorrectSavepointHandlers(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, err := f.pool.Exec(context.Background(), `CREATE TABLE seen (k int PRIMARY KEY); INSERT INTO seen VALUES (1)`)
	require.NoError(t, err)
	ins := func(ctx context.Context, q interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}, id string) error {
		_, err := q.Exec(ctx, `INSERT INTO effect VALUES ($1)`, id)
		return err
	}
	cases := map[string]func(msg *message.Message) error{
		"nested+deferred rollback": func(msg *message.Message) error {
			ctx, _, sp, err := savepoint(msg)
			if err != nil {
				return err
			}
			defer func() { _ = sp.Rollback(ctx) }()
			sp2, err := sp.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = sp2.Rollback(ctx) }()
			if err := ins(ctx, sp2, msg.UUID); err != nil {
				return err
			}
			if err := sp2.Commit(ctx); err != nil {
				return err
			}
			return sp.Commit(ctx)
		},
		"BeginFunc": func(msg *message.Message) error {
			ctx := msg.Context()
			tx, _ := middleware.PgxTxFromContext(ctx)
			return pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { return ins(ctx, sp, msg.UUID) })
		},
		"batch+copy in savepoint": func(msg *message.Message) error {
			ctx, _, sp, err := savepoint(msg)
			if err != nil {
				return err
			}
			defer func() { _ = sp.Rollback(ctx) }()
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`)
			if err := sp.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			id, _ := uuid.Parse(msg.UUID)
			if _, err := sp.CopyFrom(ctx, pgx.Identifier{"effect"}, []string{"event_id"}, pgx.CopyFromRows([][]any{{id}})); err != nil {
				return err
			}
			return sp.Commit(ctx)
		},
		// An expected failure handled by ROLLBACK TO, every error checked.
		"expected failure rolled back": func(msg *message.Message) error {
			ctx, tx, sp, err := savepoint(msg)
			if err != nil {
				return err
			}
			_, err = sp.Exec(ctx, `INSERT INTO seen VALUES (1)`)
			var pg *pgconn.PgError
			if !errors.As(err, &pg) || pg.Code != "23505" {
				_ = sp.Rollback(ctx)
				if err == nil {
					err = errors.New("expected a unique violation")
				}
				return err
			}
			if err := sp.Rollback(ctx); err != nil {
				return err
			}
			return ins(ctx, tx, msg.UUID)
		},
	}
	for name, h := range cases {
		s := f.subject(f.consumer(t, "c_"+uuid.NewString()[:6]))
		s.Handler = idempotencytest.NoPublish(h)
		tb := &fakeTB{}
		r := idempotencytest.Explore(tb, s, newMsg())
		t.Logf("%s: %d points, statements %q", name, r.Points, r.Statements)
		require.Empty(t, tb.all(), name)
	}
}

// A correct handler discards a tentative write by rolling back to its
// savepoint and, idiomatically, ignores Rollback's error: in PostgreSQL a
// failed ROLLBACK TO aborts the transaction (or the connection is gone),
// so the COMMIT can never keep the tentative row. The injected failure
// "before ROLLBACK TO SAVEPOINT" leaves the savepoint in place and the
// transaction healthy, a state the server cannot produce, so RELEASE and
// ROLLBACK TO are not points: Explore reported a double effect that cannot
// happen (found by review).
func TestExploreDoesNotFailASavepointsRollbackOnAHealthyTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		ctx, tx, sp, err := savepoint(msg)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
			_ = sp.Rollback(ctx)
			return err
		}
		_ = sp.Rollback(ctx) // discard the tentative row
		_, err = tx.Exec(ctx, `INSERT INTO effect VALUES ($1)`, msg.UUID)
		return err
	})
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, s, newMsg())
	for _, d := range r.Divergences {
		t.Logf("%s %q %s: effects %d want %d err %v", d.Point, d.Statement, d.Fault, d.Effects, d.Want, d.Err)
	}
	require.Empty(t, tb.all())
}

// savepoint opens a savepoint in msg's attempt transaction: the message's
// context, the transaction and the savepoint.
func savepoint(msg *message.Message) (context.Context, pgx.Tx, pgx.Tx, error) {
	ctx := msg.Context()
	tx, _ := middleware.PgxTxFromContext(ctx)
	sp, err := tx.Begin(ctx)
	return ctx, tx, sp, err
}
