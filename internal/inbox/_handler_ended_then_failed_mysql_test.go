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
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// TestHandlerErrorAfterAnImplicitCommitIsNotAckedWithoutItsEffect
// (endedfail): docs/guarantees.md promises "A failed attempt leaves nothing
// behind. A handler error ...: the claim and the effects roll back
// together and the message is redelivered", and that "A MySQL implicit
// commit (DDL) ... counts as ending the transaction" (handler_ended_tx,
// poisoned once). A handler whose DDL implicitly commits the attempt's
// transaction (MariaDB commits before the DDL runs, even when the DDL then
// fails: 1050 table exists) and that returns an error must be either
// poisoned (handler_ended_tx) or re-run until its whole effect is applied
// once. On MariaDB: the claim and the effect written before the DDL stay
// committed, the retry finds the claim and acks a duplicate: the event is
// acked without the rest of its effect, nothing is poisoned.
func TestHandlerErrorAfterAnImplicitCommitIsNotAckedWithoutItsEffect(t *testing.T) {
	t.Parallel()
	for _, variant := range []string{"failed-ddl", "ddl-then-error"} {
		t.Run(variant, func(t *testing.T) {
			ctx := context.Background()
			tg := testenv.NewTarget(t, testenv.TargetMariaDB, 2)
			store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, tg.DB))
			tg.Exec(t, `CREATE TABLE effect (event_id VARCHAR(36) NOT NULL, part VARCHAR(10) NOT NULL)`)
			tg.Exec(t, `CREATE TABLE tenant_existing (n int)`)
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "h8-ddl", Classifier: mysqlerr.Classify,
			}, nil)
			require.NoError(t, err)
			poison := &capture{msgs: make(chan *message.Message, 4)}
			calls := 0
			h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
				calls++
				tx, _ := inbox.SQLTxFromContext(msg.Context())
				if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'before')`, msg.UUID); err != nil {
					return nil, err
				}
				if calls == 1 {
					switch variant {
					case "failed-ddl":
						// Fails with 1050, after MariaDB's implicit commit.
						if _, err := tx.ExecContext(msg.Context(), `CREATE TABLE tenant_existing (n int)`); err != nil {
							return nil, err
						}
						return nil, errors.New("CREATE TABLE did not fail")
					case "ddl-then-error":
						if _, err := tx.ExecContext(msg.Context(), `CREATE TABLE tenant_new (n int)`); err != nil {
							return nil, err
						}
						return nil, errors.New("the handler's next step failed")
					}
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
			if len(poison.msgs) == 1 {
				return // handler_ended_tx: poisoned once, as documented
			}
			require.Equal(t, 1, count("after"),
				"acked (not poisoned) after %d handler call(s) without the effect's rest: the failed attempt's implicit commit left its claim (and 'before' x%d) behind, the retry was a duplicate",
				calls, count("before"))
			require.Equal(t, 1, count("before"), "effect once")
		})
	}
}
