package middleware_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A horizon widened after a purge by the shorter one: a consumer started
// then refuses the redelivery of a purged event (its window is the time
// since the purge), and the refusal says why its horizon is that short and
// what the table keeps, so that an operator does not read "horizon 1s" as a
// misconfiguration (found by a new user's trial).
func TestRefusalAfterAWideningNamesTheTablesHorizon(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		widened time.Duration
		says    string // what the refusal says the table keeps
		// never: what it must not promise (a table that keeps none
		// keeps its window at the time since the purge for good).
		never string
	}{
		{widened: 4 * time.Hour, says: "the table keeps 4h0m0s: a consumer started once the purged rows are that old gets the whole horizon"},
		{widened: 0, says: "the table keeps none now", never: "whole horizon"},
	} {
		t.Run(tc.widened.String(), func(t *testing.T) {
			t.Parallel()
			refusalAfterAWidening(t, tc.widened, tc.says, tc.never)
		})
	}
}

func refusalAfterAWidening(t *testing.T, widened time.Duration, says, never string) {
	e := newConsumerEnv(t)
	ctx := context.Background()
	cfg := e.config("stock")
	cfg.ReplayHorizon = 2 * time.Hour
	_, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)

	// The row of an event 3 h old, claimed when it was fresh (a store with
	// a 4 h window), then purged by the table's 2 h.
	at := time.Now().Add(-3 * time.Hour)
	id := uuidV7At(t, at)
	writer, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.PostgreSQL, Horizon: 4 * time.Hour})
	require.NoError(t, err)
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	ok, err := writer.Claim(ctx, sqldb.Pgx(tx), "stock", id)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, tx.Commit(ctx))
	purger, err := processed.NewPurger(processed.PurgerConfig{DB: e.db}, nil)
	require.NoError(t, err)
	n, ran, err := purger.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	require.Positive(t, n, "the row (and its copy in the UUIDv7 table) purged")

	require.NoError(t, processed.SetReplayHorizon(ctx, e.db, "", widened))
	cfg.ReplayHorizon = widened
	restarted, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	calls := 0
	_, err = restarted.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(*message.Message) error {
		calls++
		return nil
	})
	require.NoError(t, err)
	poisoned, err := e.pubsub.Subscribe(ctx, "poison")
	require.NoError(t, err)
	runRouter(t, r)

	msg, err := marshaler.NewMessageWithID(id, "order.placed", at, map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	require.NoError(t, e.pubsub.Publish("orders", msg))
	select {
	case p := <-poisoned:
		p.Ack()
		require.Equal(t, id.String(), p.UUID)
		reason := p.Metadata.Get("reason_poisoned")
		require.Contains(t, reason, "older than the replay horizon", "its row was purged: refused as expired")
		require.True(t, strings.Contains(reason, says), "the refusal names the table's horizon: %s", reason)
		if never != "" {
			require.NotContains(t, reason, never)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the redelivery of a purged event was not refused")
	}
	require.Zero(t, calls)
}
