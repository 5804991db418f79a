package processedstore_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// tzChildEnv makes TestClaimAndPurgeAcrossProcessTimeZones run as one of
// its child processes: "claim" or "purge", with the target, the database
// and the events in the other variables.
const tzChildEnv = "PROCESSED_TEST_TZ_CHILD"

// A consumer whose process runs in America/Anchorage (UTC−9/−8) claims two
// events 50 minutes old, one dated by its UUIDv7 id and one by its
// occurred_at; then a process in Pacific/Kiritimati (UTC+14) purges with a
// one-hour horizon and receives both again: the rows were kept and the
// redeliveries are duplicates, on every dialect. The times the store
// writes and compares are instants (UTC text on SQLite, which takes the
// process clock; UTC DATETIME on MySQL), never the process's local time.
func TestClaimAndPurgeAcrossProcessTimeZones(t *testing.T) {
	if mode := os.Getenv(tzChildEnv); mode != "" {
		tzChild(t, mode)
		return
	}
	t.Parallel()
	for _, name := range []string{testenv.TargetPostgresPgx, testenv.TargetMariaDB, testenv.TargetSQLite} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tg := testenv.NewTarget(t, name, 4)
			s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, s.Migrate(context.Background(), tg.DB))
			at := time.Now().Add(-50 * time.Minute)
			env := []string{"TZ_CHILD_TARGET=" + name, "TZ_CHILD_DATABASE=" + tg.Database,
				"TZ_CHILD_V7=" + v7At(at).String(), "TZ_CHILD_V4=" + uuid.NewString(), "TZ_CHILD_AT=" + at.UTC().Format(time.RFC3339Nano)}
			for _, c := range [][2]string{{"claim", "America/Anchorage"}, {"purge", "Pacific/Kiritimati"}} {
				cmd := exec.Command(os.Args[0], "-test.run=^TestClaimAndPurgeAcrossProcessTimeZones$", "-test.count=1")
				cmd.Env = append(os.Environ(), append(env, tzChildEnv+"="+c[0], "TZ="+c[1])...)
				out, err := cmd.CombinedOutput()
				require.NoError(t, err, "%s in %s: %s", c[0], c[1], out)
				require.True(t, strings.Contains(string(out), "PASS"), "%s in %s: %s", c[0], c[1], out)
			}
		})
	}
}

// tzChild claims the events (mode "claim": each is new) or purges and
// claims them again (mode "purge": each is a duplicate).
func tzChild(t *testing.T, mode string) {
	ctx := context.Background()
	tg := testenv.OpenTarget(t, os.Getenv("TZ_CHILD_TARGET"), os.Getenv("TZ_CHILD_DATABASE"), 2)
	s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	at, err := time.Parse(time.RFC3339Nano, os.Getenv("TZ_CHILD_AT"))
	require.NoError(t, err)
	at = at.Local() // an occurred_at as the process reads it
	if mode == "purge" {
		p, err := processedstore.NewPurger(s, tg.Pool, processedstore.PurgerConfig{Horizon: time.Hour}, nil)
		require.NoError(t, err)
		_, ran, err := p.PurgeNow(ctx)
		require.NoError(t, err)
		require.True(t, ran)
	}
	for _, id := range []uuid.UUID{uuid.MustParse(os.Getenv("TZ_CHILD_V7")), uuid.MustParse(os.Getenv("TZ_CHILD_V4"))} {
		tx, err := tg.BeginTx(ctx)
		require.NoError(t, err)
		ok, err := s.ClaimAt(ctx, tx, "c", id, at)
		if err != nil {
			_ = tx.Rollback()
		} else {
			require.NoError(t, tx.Commit())
		}
		require.NoError(t, err, "%s: event %s (%s)", mode, id, at)
		require.Equal(t, mode == "claim", ok, "%s: event %s: claimed (true) or a duplicate (false)", mode, id)
	}
}
