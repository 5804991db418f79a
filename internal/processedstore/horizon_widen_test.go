package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// A horizon widened (longer, or 0: none) after the purge deleted rows by
// the shorter one: a consumer started with the new value must not accept
// the redelivery of an event whose row was purged.
func TestHorizonWidenedAfterAPurgeNeverAcceptsAPurgedEvent(t *testing.T) {
	t.Parallel()
	for _, widened := range []time.Duration{4 * time.Hour, 0} {
		t.Run(widened.String(), func(t *testing.T) {
			t.Parallel()
			eachTarget(t, func(t *testing.T, tg target) {
				ctx := context.Background()
				tg.store(t)
				short := consumerStore(t, tg, 2*time.Hour)
				require.Equal(t, 2*time.Hour, short.Horizon())
				// The row a consumer at 2 h wrote when the event was fresh.
				id := v7At(time.Now().Add(-3 * time.Hour))
				writer, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: 4 * time.Hour})
				require.NoError(t, err)
				require.True(t, claimCommitted(t, tg, writer, id))
				require.False(t, claimCommitted(t, tg, short, id), "expired for the 2 h consumer")
				n, _, err := tablePurger(t, tg).PurgeNow(ctx)
				require.NoError(t, err)
				require.EqualValues(t, 1, n, "older than 2 h: purged")

				require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, widened, time.Now()))
				restarted := consumerStore(t, tg, widened)
				require.False(t, claimCommitted(t, tg, restarted, id),
					"its row was purged: the redelivery must be refused as expired, not applied again")
			})
		})
	}
}

// The purge's mark narrows nothing while the horizon stays: a consumer
// started after a purge by its own horizon keeps that horizon and accepts
// an event just inside it; one started after a widening gets the time since
// the mark (under the old horizon, over the slack), and keeps refusing
// what the old horizon purged.
func TestPurgeMarkNarrowsOnlyAWidenedHorizon(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		tg.store(t)
		first := consumerStore(t, tg, 2*time.Hour)
		require.False(t, claimCommitted(t, tg, first, v7At(time.Now().Add(-3*time.Hour))), "expired before any purge")
		_, _, err := tablePurger(t, tg).PurgeNow(ctx)
		require.NoError(t, err)

		again := consumerStore(t, tg, 2*time.Hour)
		require.Equal(t, 2*time.Hour, again.Horizon(), "a purge by the table's own horizon narrows nothing")
		require.True(t, claimCommitted(t, tg, again, v7At(time.Now().Add(-2*time.Hour+time.Minute))), "inside the horizon: applied")

		require.NoError(t, tgStore(t, tg).SetHorizon(ctx, tg.db, 6*time.Hour, time.Now()))
		widened := consumerStore(t, tg, 6*time.Hour)
		require.Less(t, widened.Horizon(), 2*time.Hour, "the rows the 2 h purge deleted stay refused")
		require.Greater(t, widened.Horizon(), 2*time.Hour-10*time.Minute, "by the mark's slack at most")
	})
}
