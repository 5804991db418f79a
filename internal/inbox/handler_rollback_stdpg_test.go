package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// docs/guarantees.md: ROLLBACK by SQL "fails the attempt as permanent
// (reason `handler_ended_tx`, poisoned once), on every driver and dialect,
// also when the handler then returns an error". PostgreSQL through
// database/sql (pgx stdlib).
func TestHandlerRollbackBySQLThenErrorIsPoisonedOnStdlibPostgres(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetPostgresStdlib, 2)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, tg.DB))
	tg.Exec(t, `CREATE TABLE effect (event_id text NOT NULL)`)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "h10-rb-pg",
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 4)}
	calls := 0
	h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		calls++
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		if calls == 1 {
			if _, err := tx.ExecContext(msg.Context(), `ROLLBACK`); err != nil {
				return nil, err
			}
		}
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if calls == 1 {
			return nil, errors.New("the handler's next step failed")
		}
		return nil, nil
	})
	id := uuid.Must(uuid.NewV7()).String()
	_, _ = h(newMsg(id))
	var n int
	require.NoError(t, tg.Std.QueryRow(`SELECT count(*) FROM effect WHERE event_id = $1`, id).Scan(&n))
	if len(poison.msgs) == 1 {
		return
	}
	require.Equal(t, 1, n, "not poisoned after %d handler calls: the row written after the handler's ROLLBACK was autocommitted, and the retry wrote it again", calls)
}
