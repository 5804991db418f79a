package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// A consumer at horizon 0 on a table that keeps none records none: the
// table still keeps none (its claim refuses nothing, nothing is purged),
// and a later consumer with a horizon records its own. The purge waits
// HorizonChangeGrace before using it (the consumer started at 0 refuses
// nothing until restarted), then purges by it; 0 adopts it, and another
// non-zero value is still refused.
func TestAdoptHorizonZeroRecordsNone(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		now := time.Now()
		week := 7 * 24 * time.Hour

		got, _, err := s.AdoptHorizon(ctx, tg.db, 0, now)
		require.NoError(t, err)
		require.Zero(t, got, "none: the claim refuses nothing")
		cur, _, _, _, err := s.TableHorizon(ctx, tg.db)
		require.NoError(t, err)
		require.Zero(t, cur, "the table still keeps none")
		for _, at := range []time.Time{now, now.Add(30 * 24 * time.Hour)} {
			_, ok, err := s.PurgeHorizon(ctx, tg.db, at)
			require.NoError(t, err)
			require.False(t, ok, "a table that keeps none is never purged")
		}

		got, _, err = s.AdoptHorizon(ctx, tg.db, week, now)
		require.NoError(t, err, "the table keeps none: the configured horizon is recorded")
		require.Equal(t, week, got)
		cur, _, _, _, err = s.TableHorizon(ctx, tg.db)
		require.NoError(t, err)
		require.Equal(t, week, cur)
		_, ok, err := s.PurgeHorizon(ctx, tg.db, now.Add(processedstore.HorizonChangeGrace-time.Minute))
		require.NoError(t, err)
		require.False(t, ok, "within the grace the consumer started at 0 may still refuse nothing")
		h, ok, err := s.PurgeHorizon(ctx, tg.db, now.Add(processedstore.HorizonChangeGrace))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, week, h)

		got, _, err = s.AdoptHorizon(ctx, tg.db, 0, now)
		require.NoError(t, err)
		require.Equal(t, week, got, "0 adopts the recorded horizon")
		_, _, err = s.AdoptHorizon(ctx, tg.db, 2*week, now)
		require.ErrorIs(t, err, processedstore.ErrHorizonMismatch)
		cur, _, _, _, err = s.TableHorizon(ctx, tg.db)
		require.NoError(t, err)
		require.Equal(t, week, cur, "a refused consumer changes nothing")
	})
}

// A horizon recorded on a table no consumer started on (no horizon row) is
// used by the purge at once, by a consumer or by SetHorizon; one set over a
// recorded 0 (none) waits HorizonChangeGrace, as one recorded by a
// consumer does.
func TestHorizonFromNoneGrace(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		now := time.Now()

		got, _, err := s.AdoptHorizon(ctx, tg.db, 2*time.Hour, now)
		require.NoError(t, err)
		require.Equal(t, 2*time.Hour, got)
		h, ok, err := s.PurgeHorizon(ctx, tg.db, now)
		require.NoError(t, err)
		require.True(t, ok, "no consumer ran without a window")
		require.Equal(t, 2*time.Hour, h)

		require.NoError(t, s.SetHorizon(ctx, tg.db, 0, now))
		_, ok, err = s.PurgeHorizon(ctx, tg.db, now)
		require.NoError(t, err)
		require.False(t, ok)
		require.NoError(t, s.SetHorizon(ctx, tg.db, 3*time.Hour, now))
		_, ok, err = s.PurgeHorizon(ctx, tg.db, now)
		require.NoError(t, err)
		require.False(t, ok, "set from none: consumers started at 0 refuse nothing until restarted")
		h, ok, err = s.PurgeHorizon(ctx, tg.db, now.Add(processedstore.HorizonChangeGrace))
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 3*time.Hour, h)
	})
}

// SetHorizon on a table that keeps no horizon row records it at once.
func TestSetHorizonOnAFreshTable(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		now := time.Now()
		require.NoError(t, s.SetHorizon(ctx, tg.db, 2*time.Hour, now))
		h, ok, err := s.PurgeHorizon(ctx, tg.db, now)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 2*time.Hour, h)
		require.NoError(t, s.SetHorizon(ctx, tg.db, 4*time.Hour, now))
		h, ok, err = s.PurgeHorizon(ctx, tg.db, now)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 4*time.Hour, h, "a longer horizon at once")
	})
}

// The purger of the table's horizon refuses one below its MinHorizon (a
// mistyped horizon, 30 minutes for 30 hours): the run fails with
// ErrHorizonTooShort and deletes nothing; a MinHorizon below it lets it
// purge.
func TestPurgerRefusesATableHorizonBelowMinHorizon(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		require.NoError(t, s.SetHorizon(ctx, tg.db, 30*time.Minute, time.Now())) // a fresh table: in force at once
		old := v7At(time.Now().Add(-2 * time.Hour))
		require.True(t, claimCommitted(t, tg, tgStore(t, tg), old))
		n, _, err := tablePurger(t, tg).PurgeNow(ctx) // MinHorizon: 1 h by default
		require.ErrorIs(t, err, processedstore.ErrHorizonTooShort)
		require.Zero(t, n)
		require.False(t, claimCommitted(t, tg, tgStore(t, tg), old), "nothing was purged")

		p, err := processedstore.NewPurger(tgStore(t, tg), tg.pool, processedstore.PurgerConfig{FromTable: true, MinHorizon: 10 * time.Minute}, nil)
		require.NoError(t, err)
		n, ran, err := p.PurgeNow(ctx)
		require.NoError(t, err)
		require.True(t, ran)
		require.EqualValues(t, v7ClaimRows(tg), n)
	})
}

// v7ClaimRows is how many rows a UUIDv7 claim made through the table
// writes: on PostgreSQL its copy in processed_event_v7 too (migration 8's
// trigger), which the purger deletes with it.
func v7ClaimRows(tg target) int {
	if tg.dialect == sqldb.PostgreSQL {
		return 2
	}
	return 1
}
