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

// TestHandlerEndingTheTransactionBySQLThenFailingIsPoisonedOnSQLite
// (endedfail): "A handler that commits or rolls it back itself, by method
// or by SQL ... fails the attempt as permanent (reason handler_ended_tx,
// poisoned once), on every driver and dialect". The savepoint marker is
// only checked on the COMMIT path: a handler that ends the transaction by
// SQL and then returns an error is retried as ordinary. After COMMIT the
// retry is a duplicate, acked without the effect's rest; after ROLLBACK
// the writes it made in autocommit stay and the retry applies the effect
// a second time.
func TestHandlerEndingTheTransactionBySQLThenFailingIsPoisonedOnSQLite(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"COMMIT", "ROLLBACK"} {
		t.Run(end, func(t *testing.T) {
			ctx := context.Background()
			tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
			store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, tg.DB))
			tg.Exec(t, `CREATE TABLE effect (event_id VARCHAR(36) NOT NULL, part VARCHAR(10) NOT NULL)`)
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "h8-lite",
			}, nil)
			require.NoError(t, err)
			poison := &capture{msgs: make(chan *message.Message, 4)}
			calls := 0
			h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
				calls++
				tx, _ := inbox.SQLTxFromContext(msg.Context())
				if calls == 1 {
					if _, err := tx.ExecContext(msg.Context(), end); err != nil {
						return nil, err
					}
					if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'before')`, msg.UUID); err != nil {
						return nil, err
					}
					return nil, errors.New("the handler's next step failed")
				}
				if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'before')`, msg.UUID); err != nil {
					return nil, err
				}
				_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'after')`, msg.UUID)
				return nil, err
			})
			id := uuid.Must(uuid.NewV7()).String()
			_, err = h(newMsg(id))
			require.NoError(t, err)
			count := func(part string) int {
				var n int
				require.NoError(t, tg.Std.QueryRow(`SELECT count(*) FROM effect WHERE event_id = ? AND part = ?`, id, part).Scan(&n))
				return n
			}
			require.Len(t, poison.msgs, 1, "handler_ended_tx: poisoned once (handler calls %d, effect before x%d, after x%d)",
				calls, count("before"), count("after"))
		})
	}
}
