package processed_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/processed"
)

const migrateKillEnv = "IDEMPOTENCY_MIGRATE_KILL_CHILD" // target|database|k

// TestMigrateKilledAfterAnyStatementCompletesOnRestart: on MySQL/MariaDB
// and SQLite each statement of a migration commits on its own and the
// version is recorded after the last one. A process killed in between (a
// rollout, a liveness probe during an upgrade) left a statement applied
// and its version unrecorded, and every later Migrate failed on it (1060
// duplicate column, SQLite's "duplicate column name"): the service could
// never start again. A child process runs processed.Migrate on a fresh
// database and SIGKILLs itself after its k-th statement, for every k;
// Migrate then completes and records every version.
func TestMigrateKilledAfterAnyStatementCompletesOnRestart(t *testing.T) {
	if v := os.Getenv(migrateKillEnv); v != "" {
		os.Exit(migrateKillChild(t, v))
	}
	ctx := context.Background()
	for _, name := range []string{testenv.TargetMariaDB, testenv.TargetSQLite} {
		t.Run(name, func(t *testing.T) {
			clean := testenv.NewTarget(t, name, 2)
			require.NoError(t, processed.Migrate(ctx, clean.Handle(), processed.Config{}))
			want := recordedVersions(t, clean)
			for k := 1; ; k++ {
				tg := testenv.NewTarget(t, name, 2)
				cmd := exec.Command(os.Args[0], "-test.run=^TestMigrateKilledAfterAnyStatementCompletesOnRestart$")
				cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s|%s|%d", migrateKillEnv, name, tg.Database, k))
				out, err := cmd.CombinedOutput()
				var ee *exec.ExitError
				if !errors.As(err, &ee) || !ee.Sys().(syscall.WaitStatus).Signaled() {
					require.NoError(t, err, "%s", out)
					require.Contains(t, string(out), "migrated", "%s", out)
					require.Greater(t, k, 1, "no statement was reached")
					break // fewer than k statements: every window was tried
				}
				require.NoError(t, processed.Migrate(ctx, tg.Handle(), processed.Config{}),
					"Migrate after a process killed after statement %d", k)
				require.Equal(t, want, recordedVersions(t, tg), "every version recorded after a kill after statement %d", k)
				var one int
				err = tg.DB.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_at IS NULL AND event_name IS NULL AND fingerprint IS NULL`).Scan(&one)
				require.NoError(t, err, "the table has every column after a kill after statement %d", k)
			}
		})
	}
}

func migrateKillChild(t *testing.T, v string) int {
	parts := strings.SplitN(v, "|", 3)
	k, _ := strconv.Atoi(parts[2])
	tg := testenv.OpenTarget(t, parts[0], parts[1], 2)
	n := 0
	crashpoint.Set(func(name string) {
		if name != crashpoint.MigrationStatementApplied {
			return
		}
		if n++; n == k {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
	})
	if err := processed.Migrate(context.Background(), tg.Handle(), processed.Config{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fmt.Println("migrated")
	return 0
}

func recordedVersions(t *testing.T, tg testenv.Target) int {
	t.Helper()
	var n int
	require.NoError(t, tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_migration WHERE component LIKE 'processed:%'`).Scan(&n))
	return n
}
