package processedstore

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Every lean claim takes the lock timeout into its WHERE, before the
// window (the pgx beginner's backstop when the session carries the
// lock timeout); a statement that is not a lean claim is refused, so the
// beginner keeps its SET LOCAL there.
func TestEveryLeanClaimTakesTheLockTimeoutIntoItsWhere(t *testing.T) {
	for _, horizon := range []time.Duration{0, time.Hour} {
		s, err := NewStore(Config{Table: "app.processed_event", Horizon: horizon})
		if err != nil {
			t.Fatal(err)
		}
		for v7 := range s.lean {
			for id := range s.lean[v7] {
				got, ok := LeanClaimWithLockTimeout(s.lean[v7][id], 1500*time.Millisecond)
				if !ok {
					t.Fatalf("lean claim [%d][%d] refused: %s", v7, id, s.lean[v7][id])
				}
				set := "CASE WHEN current_setting('lock_timeout') = '1500ms' THEN true ELSE set_config('lock_timeout', '1500ms', true) IS NOT NULL END AND "
				if !strings.Contains(got, "\nWHERE "+set+"(") || strings.Replace(got, set, "", 1) != s.lean[v7][id] {
					t.Fatalf("lean claim [%d][%d]: %s", v7, id, got)
				}
			}
		}
		if _, ok := LeanClaimWithLockTimeout(s.claimSQL, time.Second); ok {
			t.Fatalf("the classic claim was taken: %s", s.claimSQL)
		}
	}
}

// The backstop compares the session's lock_timeout as PostgreSQL shows it
// (current_setting) with millisText: a mismatch would only cost a
// set_config per claim, so the two are compared on the server.
func TestMillisTextIsHowPostgreSQLShowsTheLockTimeout(t *testing.T) {
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	for _, ms := range []int64{0, 1, 999, 1000, 1500, 5000, 59999, 60000, 90000, 120000, 3600000, 5400000, 86400000, 172800000, 2147483647} {
		var shown string
		require.NoError(t, pool.QueryRow(ctx, `SELECT set_config('lock_timeout', $1, true)`, strconv.FormatInt(ms, 10)+"ms").Scan(&shown))
		require.Equal(t, shown, millisText(ms), "%d ms", ms)
	}
}

// The claim without the window's future arm (ClaimParams.SQLNear), which
// the pgx beginner sends for an event it knows is inside MaxFutureSkew,
// keeps the past arm that the purge's safety rests on: an event older than
// the horizon by the database clock inserts nothing, on every lean
// variant; one dated ahead is not judged by it. A store without a horizon
// has none (its claim has no window).
func TestNearClaimKeepsThePastArmOfTheWindow(t *testing.T) {
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	s, err := NewStore(Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	for v7 := range s.leanNear {
		for id := range s.leanNear[v7] {
			near := s.leanNear[v7][id]
			require.NotContains(t, near, "+ interval", "[%d][%d]: %s", v7, id, near)
			_, ok := LeanClaimWithLockTimeout(near, time.Second)
			require.True(t, ok, "[%d][%d] takes the lock timeout's check: %s", v7, id, near)
			for _, c := range []struct {
				at   time.Duration
				rows int64
			}{{-2 * time.Hour, 0}, {-30 * time.Minute, 1}, {time.Hour, 1}} {
				eventID := uuid.New()
				if v7 == 1 {
					eventID = uuid.Must(uuid.NewV7())
				}
				args := []any{"stock", eventID, time.Now().Add(c.at)}
				if id == 1 {
					args = append(args, "order.placed", []byte{1})
				}
				n, err := sqldb.Pgx(pool).Exec(ctx, near, args...)
				require.NoError(t, err)
				require.Equal(t, c.rows, n, "[%d][%d] an event dated %s", v7, id, c.at)
			}
		}
	}
	plain, err := NewStore(Config{Table: schema + ".processed_event"})
	require.NoError(t, err)
	p, ok := plain.ClaimParamsAt("stock", uuid.Must(uuid.NewV7()), time.Time{}, nil)
	require.True(t, ok)
	require.Empty(t, p.SQLNear, "no horizon, no window")
}
