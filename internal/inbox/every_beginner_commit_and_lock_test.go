package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// everyPostgresBeginner builds, on e's schema, each PostgreSQL beginner a
// consumer can be given: pgx pipelined (NewConsumer's), pgx unpipelined,
// and database/sql through pgx's stdlib.
func everyPostgresBeginner(t *testing.T, e *env) map[string]func() inbox.TxBeginner {
	t.Helper()
	db, err := sql.Open("pgx", testenv.SchemaURL(e.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return map[string]func() inbox.TxBeginner{
		"pgx": func() inbox.TxBeginner {
			return mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{}))
		},
		"pgx unpipelined": func() inbox.TxBeginner {
			return mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{DisablePipeline: true}))
		},
		"database/sql": func() inbox.TxBeginner { return mustBeginner(inbox.NewStdBeginner(db)) },
	}
}

// A handler that swallows a database error and returns nil: PostgreSQL
// has aborted the transaction and answers ROLLBACK to COMMIT, so the
// attempt fails (ErrCommit) and nothing is acked, claimed or applied, on
// every beginner.
func TestSwallowedDatabaseErrorFailsTheAttemptOnEveryBeginner(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for name, beginner := range everyPostgresBeginner(t, e) {
		t.Run(name, func(t *testing.T) {
			m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner(), Store: e.store, Consumer: "swallow " + name}, watermill.NopLogger{})
			require.NoError(t, err)
			id := uuid.Must(uuid.NewV7()).String()
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				require.NoError(t, writeEffectQ(msg, name))
				q, _ := inbox.QuerierFromContext(msg.Context())
				_, err := q.Exec(msg.Context(), `INSERT INTO no_such_table VALUES (1)`)
				require.Error(t, err) // swallowed
				return nil, nil
			})
			_, err = h(newMsg(id))
			require.ErrorIs(t, err, inbox.ErrCommit, "a COMMIT the server answered with ROLLBACK is a failure")
			require.Equal(t, 0, e.count(`SELECT count(*) FROM processed_event WHERE consumer = $1`, "swallow "+name))
			require.Equal(t, 0, e.effects(id))
		})
	}
}

// Two deliveries of one event at once: the second waits for the first's
// claim at most its LockTimeout, then fails as the transient ErrInFlight
// (never poisoned), on every beginner; the first then applies the event
// once. An unbounded wait fails the test at its failsafe instead of
// hanging it.
func TestLockTimeoutIsTransientInFlightOnEveryBeginner(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for name, beginner := range everyPostgresBeginner(t, e) {
		t.Run(name, func(t *testing.T) {
			consumer := "inflight " + name
			slowM, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner(), Store: e.store, Consumer: consumer}, watermill.NopLogger{})
			require.NoError(t, err)
			fastM, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner(), Store: e.store, Consumer: consumer, LockTimeout: 100 * time.Millisecond}, watermill.NopLogger{})
			require.NoError(t, err)
			release, holding := make(chan struct{}), make(chan struct{})
			slow := slowM.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				close(holding)
				<-release
				return nil, writeEffectQ(msg, name)
			})
			fast := fastM.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				t.Error("handler must not run while the claim is held elsewhere")
				return nil, nil
			})
			id := uuid.Must(uuid.NewV7()).String()
			done := make(chan error, 1)
			go func() { _, err := slow(newMsg(id)); done <- err }()
			<-holding
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			msg := newMsg(id)
			msg.SetContext(ctx)
			_, err = fast(msg)
			close(release)
			require.False(t, errors.Is(ctx.Err(), context.DeadlineExceeded), "the second delivery waited until the failsafe: the lock timeout is not in force (%v)", err)
			require.ErrorIs(t, err, inbox.ErrInFlight)
			require.True(t, inbox.IsTransient(err))
			require.False(t, inbox.IsPermanent(err))
			require.NoError(t, <-done)
			require.Equal(t, 1, e.effects(id))
		})
	}
}
