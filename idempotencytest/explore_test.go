package idempotencytest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
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

// A handler that commits the attempt's transaction through pgx (tx.Commit)
// has its delivery poisoned by the chain ("handler_ended_tx"), which acks
// it: the clean delivery returns nil but was dead-lettered, and Explore
// reports it instead of comparing one poisoned delivery with another.
func TestExploreReportsAHandlerThatCommitsTheTransactionThroughPgx(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return tx.Commit(msg.Context()) // the mistake
	})
	tb := &fakeTB{}
	idempotencytest.Explore(tb, s, newMsg())
	require.Contains(t, tb.all(), "the clean delivery was poisoned")
	require.Contains(t, tb.all(), "ended the attempt's transaction")
}

// WantEffects defaults to 1 for Explore as for the other helpers: an
// Effects that counts nothing (the wrong table, the wrong key) makes the
// clean delivery and every redelivery agree on 0, and Explore must not
// pass on that.
func TestExploreFailsWhenTheCleanDeliveryHasNoEffect(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		_, err := f.pool.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID) // a write through the pool
		return err
	})
	s.Effects = func(context.Context, *message.Message) (int, error) { return 0, nil } // counts nothing
	tb := &fakeTB{}
	idempotencytest.Explore(tb, s, newMsg())
	require.Contains(t, tb.all(), "0 effects after the clean delivery, want 1")
}

// A handler that panics only when it is entered again for an event: every
// point's redelivery is poisoned. Explore says so, not only that the
// effect is missing.
func TestExploreNamesAPoisonedRedelivery(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	var mu sync.Mutex
	seen := map[string]bool{}
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		mu.Lock()
		again := seen[msg.UUID]
		seen[msg.UUID] = true
		mu.Unlock()
		if again {
			panic("entered again") // the mistake
		}
		return f.handler(msg)
	})
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, s, newMsg())
	require.NotEmpty(t, r.Divergences)
	require.ErrorContains(t, r.Divergences[0].Err, "poisoned")
	require.Contains(t, tb.all(), "entered again")
}

// Subject.Timeout bounds each point of an exploration, not all of them
// together: the points grow with the handler's statements, and each
// redelivery waits the consumer's retry backoff (here the default, 100
// ms), so a handler with enough statements (thirty under the default
// Timeout) outlasted one budget for all, and its last points were reported
// as never succeeding although it is correct.
func TestExploreTimeoutBoundsEachPoint(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "c", DB: f.db,
		Poison: middleware.PoisonConfig{Publisher: f.poison, Topic: "poison"},
	}, nil)
	require.NoError(t, err)
	s := f.subject(c)
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `SELECT 1`); err != nil {
			return err
		}
		return f.handler(msg)
	})
	s.Timeout = time.Second // 15 points each wait 100 ms before their redelivery: 1.5 s in all
	r := idempotencytest.Explore(t, s, newMsg())
	require.Len(t, r.Statements, 2)
	require.Empty(t, r.Divergences)
}

// The statements a handler sends in a savepoint (tx.Begin) and its
// CopyFrom are explored like the others: a handler that swallows the
// failure of a statement in its savepoint and returns nil loses the effect
// on that attempt, and Explore names the point. Before, only the commit
// points ran and such a handler passed (found by a new user's trial).
func TestExploreSeesTheStatementsOfASavepointAndCopyFrom(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		ctx, _, sp, err := savepoint(msg)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
			_ = sp.Rollback(ctx)
			return nil // the mistake: the failure is swallowed
		}
		return sp.Commit(ctx)
	})
	tb := &fakeTB{}
	r := idempotencytest.Explore(tb, s, newMsg())
	require.Equal(t, []string{"SAVEPOINT", `INSERT INTO effect VALUES ($1)`}, r.Statements)
	require.NotEmpty(t, r.Divergences, "the swallowed failure loses the effect")
	require.Contains(t, tb.all(), "INSERT INTO effect")

	// CopyFrom, correct: seen, nothing reported.
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		id, err := uuid.Parse(msg.UUID)
		if err != nil {
			return err
		}
		_, err = tx.CopyFrom(msg.Context(), pgx.Identifier{"effect"}, []string{"event_id"}, pgx.CopyFromRows([][]any{{id}}))
		return err
	})
	r = idempotencytest.Explore(t, s, newMsg())
	require.Equal(t, []string{`COPY "effect" FROM STDIN`}, r.Statements)
	require.Empty(t, r.Divergences)
}

// What a handler sends through tx.Conn() is not seen: when it sent
// nothing on the transaction itself, Explore says so instead of passing a
// handler it could not explore. A handler that also uses the connection
// for what sends nothing (its type map) is not reported.
func TestExploreReportsStatementsSentThroughTheConnection(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Conn().Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID)
		return err
	})
	tb := &fakeTB{}
	idempotencytest.Explore(tb, s, newMsg())
	require.Contains(t, tb.all(), "the handler sent no statement on the attempt's transaction but used tx.Conn()")
}

func TestExploreDoesNotReportAConnectionUsedBesideTheTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_ = tx.Conn().TypeMap() // sends nothing
		return f.handler(msg)
	})
	r := idempotencytest.Explore(t, s, newMsg())
	require.Len(t, r.Statements, 1)
	require.Empty(t, r.Divergences)
}
