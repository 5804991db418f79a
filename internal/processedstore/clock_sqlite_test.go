package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// On SQLite the processed store's clock is the process clock in
// microseconds (the database is in-process): over 200 claims of events
// with no time of their own, with and without the replay window, the
// stored event_at and processed_at are never earlier than a Go clock read
// just before the claim nor later than one read just after, and they have
// microsecond resolution. SQLite's strftime('now') has milliseconds and
// read earlier than the Go clock read before it.
func TestSQLiteClaimTimesAreTheProcessClock(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
	ctx := context.Background()
	var stores []*processedstore.Store
	for _, h := range []time.Duration{0, time.Hour} {
		s, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite, Horizon: h})
		require.NoError(t, err)
		require.NoError(t, s.Migrate(ctx, tg.DB))
		stores = append(stores, s)
	}
	subMillisecond := 0
	for i := 0; i < 200; i++ {
		id := uuid.New() // a v4 id: no time of its own, dated by the clock
		before := time.Now()
		tx := tg.Begin(t)
		ok, err := stores[i%2].Claim(ctx, tx, "c", id)
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, tx.Commit())
		after := time.Now()
		var eventAt, processedAt sqldb.Time
		require.NoError(t, tg.DB.QueryRow(ctx, `SELECT event_at, processed_at FROM processed_event WHERE event_id = ?`, id[:]).Scan(&eventAt, &processedAt))
		for name, got := range map[string]time.Time{"event_at": eventAt.T, "processed_at": processedAt.T} {
			require.GreaterOrEqual(t, got.UnixMicro(), before.UnixMicro(), "claim %d: %s stored before the Go clock read just before it", i, name)
			require.LessOrEqual(t, got.UnixMicro(), after.UnixMicro(), "claim %d: %s stored after the Go clock read just after it", i, name)
		}
		if eventAt.T.UnixMicro()%1000 != 0 {
			subMillisecond++
		}
	}
	require.Greater(t, subMillisecond, 100, "microsecond resolution")
}

// On SQLite the replay window and the purge cutoff are exact to the
// microsecond on the store's process clock. The test sets that clock a
// minute behind the machine's, so a store that reads any other clock
// fails. Horizon 1 h, MaxFutureSkew 10 min: an event 1 ms or 1 µs inside
// the horizon is claimed, one 1 µs outside is refused as expired; one 1 µs
// inside the skew is claimed, one 1 µs beyond is refused as future. A
// purge with horizon 30 min keeps the rows 1 ms younger than its cutoff
// and exactly at it, and deletes those 1 µs and 1 ms older; the purge
// preview reports the same cutoff and count.
func TestSQLiteWindowAndPurgeAreExactToTheMicrosecond(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
	ctx := context.Background()
	s, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite, Horizon: time.Hour, MaxFutureSkew: 10 * time.Minute})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, tg.DB))
	clock := time.Now().Add(-time.Minute).Truncate(time.Microsecond)
	processedstore.SetClock(s, func() time.Time { return clock })
	claim := func(at time.Time) (uuid.UUID, error) {
		id := uuid.New() // a v4 id: dated by at, to the microsecond
		tx := tg.Begin(t)
		ok, err := s.ClaimAt(ctx, tx, "c", id, at)
		require.Equal(t, err == nil, ok)
		require.NoError(t, tx.Commit())
		return id, err
	}
	for _, c := range []struct {
		name string
		at   time.Time
		want error
	}{
		{"1ms inside the horizon", clock.Add(-time.Hour + time.Millisecond), nil},
		{"1µs inside the horizon", clock.Add(-time.Hour + time.Microsecond), nil},
		{"at the horizon", clock.Add(-time.Hour), nil},
		{"1µs outside the horizon", clock.Add(-time.Hour - time.Microsecond), processedstore.ErrExpired},
		{"1µs inside the skew", clock.Add(10*time.Minute - time.Microsecond), nil},
		{"1µs beyond the skew", clock.Add(10*time.Minute + time.Microsecond), processedstore.ErrFuture},
	} {
		_, err := claim(c.at)
		if c.want == nil {
			require.NoError(t, err, c.name)
		} else {
			require.ErrorIs(t, err, c.want, c.name)
		}
	}

	_, err = tg.DB.Exec(ctx, `DELETE FROM processed_event`)
	require.NoError(t, err)
	// The Purger's cutoff: the horizon plus its slack (PurgePreviewQuery
	// shows it; PurgeBatch is given both).
	cutoff := clock.Add(-30*time.Minute - processedstore.PurgeClaimSlack)
	kept, deleted := map[string]uuid.UUID{}, map[string]uuid.UUID{}
	for name, at := range map[string]time.Time{"1ms younger": cutoff.Add(time.Millisecond), "at the cutoff": cutoff} {
		id, err := claim(at)
		require.NoError(t, err, name)
		kept[name] = id
	}
	for name, at := range map[string]time.Time{"1µs older": cutoff.Add(-time.Microsecond), "1ms older": cutoff.Add(-time.Millisecond)} {
		id, err := claim(at)
		require.NoError(t, err, name)
		deleted[name] = id
	}
	query, args := s.PurgePreviewQuery(30 * time.Minute)
	var now, previewCutoff string
	var rows, older int
	var oldest sqldb.Time
	require.NoError(t, tg.DB.QueryRow(ctx, query, args...).Scan(&now, &previewCutoff, &rows, &older, &oldest))
	require.Equal(t, sqldb.SQLiteTime(cutoff), previewCutoff)
	require.Equal(t, 4, rows)
	require.Equal(t, 2, older, "the preview counts the rows older than the cutoff")

	n, err := s.PurgeBatch(ctx, tg.DB, 30*time.Minute+processedstore.PurgeClaimSlack, 100)
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	for name, id := range kept {
		done, err := s.Processed(ctx, tg.DB, "c", id)
		require.NoError(t, err)
		require.True(t, done, "%s than the cutoff: kept", name)
	}
	for name, id := range deleted {
		done, err := s.Processed(ctx, tg.DB, "c", id)
		require.NoError(t, err)
		require.False(t, done, "%s than the cutoff: purged", name)
	}
}
