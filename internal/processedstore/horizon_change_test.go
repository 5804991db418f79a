package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// consumerStore is the store NewConsumer builds: the horizon AdoptHorizon
// returned for configured, as the claim's.
func consumerStore(t *testing.T, tg target, configured time.Duration) *processedstore.Store {
	t.Helper()
	probe, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect})
	require.NoError(t, err)
	h, _, err := probe.AdoptHorizon(context.Background(), tg.db, configured, time.Now())
	require.NoError(t, err)
	s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: h})
	require.NoError(t, err)
	return s
}

// claimCommitted claims (consumer, id) in a transaction of its own and
// commits it: true when the effect would be applied.
func claimCommitted(t *testing.T, tg target, s *processedstore.Store, id uuid.UUID) bool {
	t.Helper()
	tx, end := tg.begin(t)
	ok, err := s.Claim(context.Background(), tx, "stock", id)
	end(err == nil)
	if err != nil {
		return false // refused (expired): never applied
	}
	return ok
}

func tablePurger(t *testing.T, tg target) *processedstore.Purger {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect})
	require.NoError(t, err)
	p, err := processedstore.NewPurger(s, tg.pool, processedstore.PurgerConfig{FromTable: true}, nil)
	require.NoError(t, err)
	return p
}

// A change of the horizon within HorizonChangeGrace of the previous one
// keeps the grace of the previous one: the purge never uses a horizon
// shorter than that of a consumer started before either change (one
// started at 0 on a table that kept none refuses nothing), whoever calls
// SetHorizon again in between (a deploy script re-applying its value, a
// second correction).
func TestHorizonChangeWithinGraceKeepsTheEarlierGrace(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		tg.store(t) // migrated
		// A consumer at 0 on a table that keeps none: refuses nothing.
		unbounded := consumerStore(t, tg, 0)
		require.Zero(t, unbounded.Horizon())
		id := v7At(time.Now().Add(-3 * time.Hour))
		require.True(t, claimCommitted(t, tg, unbounded, id))
		// Another consumer records 2 h; the purge waits the grace.
		require.Equal(t, 2*time.Hour, consumerStore(t, tg, 2*time.Hour).Horizon())
		_, ok, err := tgStore(t, tg).PurgeHorizon(ctx, tg.db, time.Now())
		require.NoError(t, err)
		require.False(t, ok, "recorded over none: the purge waits HorizonChangeGrace")
		// The operator re-applies the same horizon within the grace.
		require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, 2*time.Hour, time.Now()))
		_, _, err = tablePurger(t, tg).PurgeNow(ctx)
		require.NoError(t, err)
		require.False(t, claimCommitted(t, tg, unbounded, id),
			"the consumer started at 0 still runs within the grace: its redelivery must find its row, not apply the effect again")
	})
}

// Two shortenings within HorizonChangeGrace: the purge keeps the horizon
// of the consumers started before the first for the grace of the second.
func TestHorizonShortenedTwiceWithinGraceKeepsTheLongest(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		tg.store(t)
		long := consumerStore(t, tg, 6*time.Hour)
		id := v7At(time.Now().Add(-5 * time.Hour))
		require.True(t, claimCommitted(t, tg, long, id))
		s := tgStore(t, tg)
		require.NoError(t, s.SetHorizon(ctx, tg.db, 2*time.Hour, time.Now()))
		h, ok, err := tgStore(t, tg).PurgeHorizon(ctx, tg.db, time.Now())
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 6*time.Hour, h, "shortened: the previous horizon for the grace")
		require.NoError(t, s.SetHorizon(ctx, tg.db, 3*time.Hour, time.Now()))
		h, ok, err = tgStore(t, tg).PurgeHorizon(ctx, tg.db, time.Now())
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 6*time.Hour, h, "the consumer started at 6 h still runs within the first change's grace")
		_, _, err = tablePurger(t, tg).PurgeNow(ctx)
		require.NoError(t, err)
		require.False(t, claimCommitted(t, tg, long, id), "its redelivery must find its row")
	})
}

func tgStore(t *testing.T, tg target) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect})
	require.NoError(t, err)
	return s
}
