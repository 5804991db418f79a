package middleware_test

import (
	"context"
	"errors"
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

// docs/guarantees.md ("The attempt's transaction is the consumer's",
// "Database outages don't poison", "Two deliveries at the same moment"):
// only a handler that ended the attempt's transaction by SQL is poisoned
// as handler_ended_tx. Here, with pgx, the handler ends nothing: it sends an
// sqlc-style query ("-- name: ..." comment first, so the scan cannot prove
// it keeps the transaction), then its backend is terminated (a DBA's
// pg_terminate_backend, a failover: PostgreSQL aborts the transaction and
// releases the claim's lock), another worker of the same consumer
// processes the event, and the handler then fails on something else. pgx
// has not read from the dead connection yet (not closed, still 'T'): the
// other worker's commit, seen from outside, must not be taken for this
// handler's (it was, when endedByHandler read the claim on another
// connection); the guard on the attempt's own connection decides.
func TestKilledBackendWithCompetingWorkerCommitIsNotHandlerEndedTx(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	consumer := "killedbk_" + uuid.NewString()[:8]
	newConsumer := func(p *poisonRecorder) *middleware.Consumer { return poisoningConsumer(t, pool, consumer, p) }
	poisonA, poisonB := &poisonRecorder{}, &poisonRecorder{}
	var callsB atomic.Int32
	hB, err := door.Wrap(newConsumer(poisonB), "killedbk", func(msg *message.Message) ([]*message.Message, error) {
		callsB.Add(1)
		return nil, nil
	})
	require.NoError(t, err)

	msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")

	var callsA atomic.Int32
	hA, err := door.Wrap(newConsumer(poisonA), "killedbk", func(m *message.Message) ([]*message.Message, error) {
		callsA.Add(1)
		tx, _ := middleware.PgxTxFromContext(m.Context())
		var pid int32
		if err := tx.QueryRow(m.Context(), "-- name: BackendPID :one\nSELECT pg_backend_pid()").Scan(&pid); err != nil {
			return nil, err
		}
		// The backend dies (its transaction aborted, the claim's lock gone).
		_, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		for {
			var alive bool
			require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive))
			if !alive {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		// Another worker (a redelivery elsewhere) processes the event.
		other := message.NewMessage(msg.UUID, []byte(`{}`))
		other.Metadata.Set(marshaler.MetadataEventName, "order.placed")
		_, err = hB(other)
		require.NoError(t, err)
		require.EqualValues(t, 1, callsB.Load())
		return nil, errors.New("downstream service unavailable")
	})
	require.NoError(t, err)

	_, err = hA(msg)
	require.Empty(t, poisonA.reasons(), "a handler that ended nothing poisoned as handler_ended_tx")
	require.NoError(t, err)
	require.EqualValues(t, 1, callsA.Load())
}
