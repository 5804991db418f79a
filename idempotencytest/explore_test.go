package idempotencytest_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A handler that writes only through the attempt's transaction diverges
// nowhere: every failure rolls its effect back with the claim.
func TestExploreFindsNothingInACorrectHandler(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, err := f.pool.Exec(context.Background(), `CREATE TABLE audit (event_id uuid NOT NULL)`)
	require.NoError(t, err)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO audit VALUES ($1)`, msg.UUID)
		return err
	})
	r := idempotencytest.Explore(t, s, newMsg())
	require.Len(t, r.Statements, 2)
	require.Equal(t, 2*2*3+3+1, r.Points)
	require.Empty(t, r.Divergences)
}

// A write through the pool survives the rollback of a failed attempt and
// is written again by the redelivery: Explore names the point and the
// statement after which it happens.
func TestExploreFindsAWriteThroughThePool(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	_, err := f.pool.Exec(context.Background(), `CREATE TABLE audit (event_id uuid NOT NULL)`)
	require.NoError(t, err)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		if _, err := f.pool.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil { // the mistake
			return err
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO audit VALUES ($1)`, msg.UUID)
		return err
	})
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, s, newMsg())
	require.NotEmpty(t, r.Divergences)
	first := r.Divergences[0]
	require.Equal(t, "before statement 1", first.Point)
	require.Contains(t, first.Statement, "INSERT INTO audit")
	require.Equal(t, 2, first.Effects)
	require.Equal(t, 1, first.Want)
	require.Contains(t, tb.all(), "2 effects after redelivery, 1 after a clean delivery")
}

// An external call made without an operation key is made again by the
// redelivery of an attempt that failed after it.
func TestExploreFindsAnExternalCallWithoutAnOperationKey(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	provider := &idempotencytest.Provider{}
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		provider.Call(msg.UUID) // the mistake: no operation key
		return f.handler(msg)
	})
	s.Effects = func(_ context.Context, msg *message.Message) (int, error) { return provider.Calls(msg.UUID), nil }
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, s, newMsg())
	require.NotEmpty(t, r.Divergences)
	require.Equal(t, 2, r.Divergences[0].Effects)
	require.NotEmpty(t, tb.all())
}

// A handler that ends the attempt's transaction by SQL commits its claim
// outside the attempt: a failure after that loses or repeats its effect, or
// every attempt fails.
func TestExploreFindsAHandlerThatEndsTheTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `COMMIT`); err != nil { // the mistake
			return err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID)
		return err
	})
	tb := &fakeTB{}
	idempotencytest.Explore(tb, s, newMsg())
	require.NotEmpty(t, tb.all(), "Explore reports the handler")
}

// Explore refuses an incomplete subject.
func TestExploreNamesWhatIsMissing(t *testing.T) {
	t.Parallel()
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, idempotencytest.Subject{}, newMsg())
	require.Zero(t, r.Points)
	require.Contains(t, tb.all(), "Subject.Consumer")
}
