package processedstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// The claim's replay window on every dialect, judged by the database
// clock: an event dated before now − Horizon is refused as expired, one
// dated after now + MaxFutureSkew as future, one inside is claimed; a
// duplicate stays a duplicate whatever its time; an event with no time is
// claimed. The purge then deletes by the same event time.
func TestClaimWindowEveryDialect(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect, Horizon: time.Hour, MaxFutureSkew: 10 * time.Minute})
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx, tg.db))
		claim := func(id uuid.UUID, at time.Time) (bool, error) {
			q, end := tg.begin(t)
			ok, err := s.ClaimAt(ctx, q, "c", id, at)
			end(err == nil)
			return ok, err
		}
		now := time.Now()
		for _, c := range []struct {
			name string
			at   time.Time
			want error
		}{
			{"expired", now.Add(-61 * time.Minute), processedstore.ErrExpired},
			{"inside_old", now.Add(-59 * time.Minute), nil},
			{"inside_ahead", now.Add(9 * time.Minute), nil},
			{"future", now.Add(11 * time.Minute), processedstore.ErrFuture},
			{"far_future", now.Add(10 * 365 * 24 * time.Hour), processedstore.ErrFuture},
		} {
			for _, id := range []uuid.UUID{uuid.New(), v7At(c.at)} { // time from occurred_at, or from the id
				ok, err := claim(id, c.at)
				if c.want != nil {
					require.ErrorIs(t, err, c.want, c.name)
					var re *processedstore.RefusedError
					require.True(t, errors.As(err, &re), c.name)
					require.False(t, ok, c.name)
					continue
				}
				require.NoError(t, err, c.name)
				require.True(t, ok, c.name)
				ok, err = claim(id, c.at)
				require.NoError(t, err, c.name)
				require.False(t, ok, "%s: duplicate", c.name)
			}
		}
		ok, err := claim(uuid.New(), time.Time{})
		require.NoError(t, err)
		require.True(t, ok, "no event time: claimed")

		// Every row, once older than the horizon, is purged by it.
		tg.age(t, 2*time.Hour)
		n, err := s.PurgeBatch(ctx, tg.db, time.Hour, 100)
		require.NoError(t, err)
		require.EqualValues(t, 5, n)
	})
}

func v7At(at time.Time) uuid.UUID {
	id := uuid.Must(uuid.NewV7())
	ms := uint64(at.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	return id
}
