package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

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

// docs/guarantees.md: "Database outages don't poison ... (the consumer's
// own BEGIN, claim, COMMIT or ROLLBACK failing ...) is transient: the
// consumer holds the delivery". Here the attempt's session is lost before
// COMMIT (an operator's pg_terminate_backend, a failover) on every
// attempt. Earlier in the attempt the handler skipped an optional
// statement whose own budget had already run out: pgx sent nothing, the
// connection stayed open, the transaction intact. The lost session's
// failed COMMIT must still be the database's: held and given back, never
// taken for the handler's own deadline and poisoned.
func TestLostSessionAtCommitIsHeldAfterAHandlerSkippedAStatementOnAnExpiredContext(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	poison := &poisonRecorder{}
	c := poisoningConsumer(t, pool, "deadline_lost_"+uuid.NewString()[:8], poison)
	var calls atomic.Int32
	handler, err := door.Wrap(c, "lost_session", func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		// A best-effort step under a budget that is already spent: pgx
		// refuses it before sending anything (the connection stays open).
		budget, cancel := context.WithCancel(msg.Context())
		cancel()
		_, _ = tx.Exec(budget, `SELECT 1`)
		var pid int
		if err := tx.QueryRow(msg.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return nil, err
		}
		// The session is lost (pg_terminate_backend from elsewhere).
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
			return nil, err
		}
		for {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&n); err != nil {
				return nil, err
			}
			if n == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		return nil, nil
	})
	require.NoError(t, err)
	msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	_, err = handler(msg)
	require.Empty(t, poison.reasons(), "a lost session at COMMIT poisoned the message (attempts: %d)", calls.Load())
	require.Error(t, err, "held until MaxHold and given back")
	require.True(t, middleware.IsTransient(err), "a lost session at COMMIT is transient: %v", err)
}
