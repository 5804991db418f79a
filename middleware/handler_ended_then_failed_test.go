package middleware_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// docs/guarantees.md: a handler that ends the attempt's transaction by SQL
// fails the attempt as permanent (reason handler_ended_tx, poisoned once),
// on every driver. Here, with pgx, it ends it and then returns an error:
// after COMMIT the claim and the effect before it were committed, and a
// retry acked the event as a duplicate without the rest of its effects;
// after ROLLBACK the effect written after it was autocommitted, and a retry
// wrote it again. Either way the message must be poisoned once, the handler
// called once, the effect not written twice.
func TestHandlerEndingTheTransactionThenFailingIsPoisonedOnce(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)
	for _, end := range []string{"COMMIT", "ROLLBACK", "COMMIT; BEGIN"} {
		t.Run(end, func(t *testing.T) {
			poison := &poisonRecorder{}
			c := poisoningConsumer(t, pool, "ended_"+uuid.NewString()[:8], poison)
			var calls atomic.Int32
			h, err := door.Wrap(c, "ended", func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				if end == "ROLLBACK" {
					if _, err := tx.Exec(msg.Context(), end); err != nil {
						return nil, err
					}
				}
				if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID); err != nil {
					return nil, err
				}
				if end != "ROLLBACK" {
					if _, err := tx.Exec(msg.Context(), end); err != nil {
						return nil, err
					}
				}
				return nil, errors.New("the handler fails after it")
			})
			require.NoError(t, err)
			msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
			msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
			_, err = h(msg)
			require.NoError(t, err, "not poisoned")
			require.Len(t, poison.reasons(), 1)
			require.Contains(t, poison.reasons()[0], "the handler ended the attempt's transaction itself")
			require.EqualValues(t, 1, calls.Load(), "retried after the handler ended the transaction")
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, msg.UUID).Scan(&n))
			require.Equal(t, 1, n)
		})
	}
}

// The reason of a handler that ended the attempt's transaction and
// returned nil says what went wrong and nothing that did not: the produced
// messages it may have lost as "any" (it produced none here), and a
// guard's failure (the claim's row outside the transaction, SQLSTATE
// 22012) explained rather than shown as a bare division by zero (found by
// a new user's trial).
func TestHandlerEndingTheTransactionIsExplainedWithoutProducedMessages(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	for _, end := range []string{"tx.Commit", "COMMIT; BEGIN"} {
		t.Run(end, func(t *testing.T) {
			poison := &poisonRecorder{}
			c := poisoningConsumer(t, pool, "explained_"+uuid.NewString()[:8], poison)
			h, err := door.Wrap(c, "ended", func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				if end == "tx.Commit" {
					return nil, tx.Commit(msg.Context())
				}
				_, err := tx.Exec(msg.Context(), end)
				return nil, err
			})
			require.NoError(t, err)
			msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
			msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
			_, err = h(msg)
			require.NoError(t, err, "poisoned, not failed")
			require.Len(t, poison.reasons(), 1)
			reason := poison.reasons()[0]
			require.Contains(t, reason, "the handler ended the attempt's transaction itself")
			require.Contains(t, reason, "any messages it produced were not written", "it produced none: not said as a loss")
			if end != "tx.Commit" {
				require.Contains(t, reason, "the commit guard found the claim's row written outside this transaction")
			}
		})
	}
}
