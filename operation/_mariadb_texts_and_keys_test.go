package operation_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// countingCall is a provider call that always succeeds with ref and counts
// its calls.
func countingCall(n *atomic.Int32, ref string) operation.CallFunc {
	return func(context.Context, string) (operation.Result, error) {
		n.Add(1)
		return operation.Result{Reference: ref}, nil
	}
}

// NewKey accepts any printable Unicode in the entity ("🎁" is printable, so
// it is not percent-encoded), and the package doc promises the same
// protocol on MySQL/MariaDB as on PostgreSQL. The key's lock name hashes
// DATABASE() (utf8mb3) and the key as bytes: as text, a 4-byte utf8mb4
// character failed CONCAT with "Illegal mix of collations" (1271) on every
// attempt, classified transient: held and retried for ever, the provider
// never called.
func TestMariaDBKeyWithAFourByteCharacterRunsOnce(t *testing.T) {
	t.Parallel()
	e := runnerOn(t, testenv.NewTarget(t, testenv.TargetMariaDB, 4), operation.Config{})
	key := operation.MustKey("gift", "🎁-1")
	var calls atomic.Int32
	res, err := e.r.Do(context.Background(), key, map[string]any{"n": 1}, countingCall(&calls, "g-1"))
	require.NoError(t, err, "Do with a valid key (NewKey accepted %q) failed; transient=%v", key.String(), isTransient(err))
	require.Equal(t, "g-1", res.Reference)
	require.EqualValues(t, 1, calls.Load())
}

func isTransient(err error) bool {
	var tr interface{ Transient() bool }
	return errors.As(err, &tr) && tr.Transient()
}

// Result.Reference: "Stored as text, NULL when "", in a form every database
// stores ... Do returns it as stored, on every path." On MariaDB the
// reference column is LONGTEXT (migration 2): as TEXT (65 535 bytes) a
// longer reference (PostgreSQL and SQLite store it) failed the success
// write (1406, strict mode) after the charge, Do returned a transient
// ErrNotRecorded, and every later attempt reconciled, found the charge and
// failed the same write again: the record never left uncertain.
func TestMariaDBReferenceLongerThan64KiBIsRecorded(t *testing.T) {
	t.Parallel()
	e := runnerOn(t, testenv.NewTarget(t, testenv.TargetMariaDB, 4), operation.Config{})
	ctx := context.Background()
	key := operation.MustKey("charge", "long-ref")
	ref := strings.Repeat("r", 70000)
	var calls atomic.Int32
	reconcile := operation.WithReconcile(func(context.Context, operation.Record) (operation.Result, error) {
		return operation.Result{Reference: ref}, nil // the provider has it
	})
	var errs []error
	for i := 0; i < 3; i++ {
		_, err := e.r.Do(ctx, key, map[string]any{"n": 1}, countingCall(&calls, ref), reconcile)
		errs = append(errs, err)
		if err == nil {
			break
		}
		time.Sleep(operation.LeaseDuration() + 500*time.Millisecond)
	}
	rec, gerr := e.r.Get(ctx, key)
	require.NoError(t, gerr)
	t.Logf("calls=%d state=%s attempts=%d errors=%v", calls.Load(), rec.State, rec.Attempts, errs)
	require.NoError(t, errs[0], "a successful call of a %d-byte reference was not recorded", len(ref))
	require.Equal(t, operation.StateSucceeded, rec.State)
}

// The MySQL migration creates the table in the database's default character
// set (MariaDB's built-in default is latin1 before 11.6, and utf8 = utf8mb3
// is common); migration 2 makes the provider's texts (reference, error)
// utf8mb4: a reference latin1 cannot hold failed the success write (1366)
// after the provider charged, and the key looped like above.
func TestMariaDBReferenceOutsideTheDatabaseCharsetIsRecorded(t *testing.T) {
	t.Parallel()
	testenv.RequireDriver(t, "mysql")
	admin, err := sql.Open("mysql", testenv.MySQLDSN())
	require.NoError(t, err)
	defer admin.Close()
	name := testenv.UniqueName("oplatin1")
	_, err = admin.Exec("CREATE DATABASE " + name + " CHARACTER SET latin1")
	require.NoError(t, err)
	t.Cleanup(func() {
		a, err := sql.Open("mysql", testenv.MySQLDSN())
		if err == nil {
			_, _ = a.Exec("DROP DATABASE IF EXISTS " + name)
			_ = a.Close()
		}
	})
	e := runnerOn(t, testenv.OpenTarget(t, testenv.TargetMariaDB, name, 4), operation.Config{})
	ctx := context.Background()
	key := operation.MustKey("charge", "p-1")
	var calls atomic.Int32
	_, err = e.r.Do(ctx, key, map[string]any{"n": 1}, countingCall(&calls, "領収書-1"))
	rec, gerr := e.r.Get(ctx, key)
	require.NoError(t, gerr)
	t.Logf("calls=%d state=%s err=%v", calls.Load(), rec.State, err)
	require.NoError(t, err, "the provider charged; its reference could not be recorded")
	require.Equal(t, operation.StateSucceeded, rec.State)
}

// The owner's MariaDB session is killed while its call is in flight (a
// server-side KILL, wait_timeout, a proxy cutting it): GET_LOCK goes with
// it. The package doc: the owner renews its lease during the call, so
// another worker that takes the lock finds the lease live and gets an
// InProgressError (never a call), across more than one lease; the owner
// records its outcome on another connection. One call in all.
func TestMariaDBOwnerSessionKilledDuringTheCallCallsOnce(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetMariaDB, 4)
	first := runnerOn(t, tg, operation.Config{Wait: 50 * time.Millisecond})
	second := runnerOn(t, testenv.OpenTarget(t, testenv.TargetMariaDB, tg.Database, 4), operation.Config{Wait: 50 * time.Millisecond})
	ctx := context.Background()
	key := operation.MustKey("charge", "killed")
	var calls atomic.Int32
	notFound := operation.WithReconcile(func(context.Context, operation.Record) (operation.Result, error) {
		return operation.Result{}, operation.ErrNotFound
	})
	call := func(ctx context.Context, k string) (operation.Result, error) {
		calls.Add(1)
		var id sql.NullInt64
		require.NoError(t, tg.Std.QueryRow(`SELECT IS_USED_LOCK(CONCAT('idem-op:', SHA1(CONCAT(DATABASE(), '.', ?, ':', ?))))`,
			first.r.Table(), k).Scan(&id))
		require.True(t, id.Valid, "the owner holds the key's lock")
		_, err := tg.Std.Exec(fmt.Sprintf("KILL CONNECTION %d", id.Int64))
		require.NoError(t, err)
		deadline := time.Now().Add(2 * operation.LeaseDuration())
		for i := 0; time.Now().Before(deadline); i++ {
			_, err := second.r.Do(ctx, key, map[string]any{"n": 1}, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{Reference: "second"}, nil
			}, notFound)
			var ip *operation.InProgressError
			require.ErrorAs(t, err, &ip, "attempt %d of the second worker", i)
			time.Sleep(operation.LeaseDuration() / 5)
		}
		return operation.Result{Reference: "first"}, nil
	}
	res, err := first.r.Do(ctx, key, map[string]any{"n": 1}, call)
	require.NoError(t, err)
	require.Equal(t, "first", res.Reference)
	require.EqualValues(t, 1, calls.Load())
	res, err = second.r.Do(ctx, key, map[string]any{"n": 1}, countingCall(&calls, "x"))
	require.NoError(t, err)
	require.Equal(t, operation.OriginStored, res.Origin)
}

// A success write the server refuses for the statement itself (here a
// column renamed under the Runner: 1054) fails Do with ErrNotRecorded
// naming the server's error once on the attempt's connection and once on
// the pool's, its one fallback: not four times, as when every MySQL error
// was taken for a lost connection and retried three times on the pool.
// Nothing waits on it: the call's own answer is lost only for the record.
func TestMariaDBOutcomeWriteRefusedByTheServerIsNotRetriedAsALostConnection(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetMariaDB, 4)
	e := runnerOn(t, tg, operation.Config{})
	ctx := context.Background()
	call := func(context.Context, string) (operation.Result, error) {
		_, err := tg.Std.ExecContext(ctx, "ALTER TABLE operation RENAME COLUMN result TO result_gone")
		return operation.Result{Reference: "r-1"}, err
	}
	_, err := e.r.Do(ctx, operation.MustKey("charge", "renamed"), map[string]any{"n": 1}, call)
	require.ErrorIs(t, err, operation.ErrNotRecorded)
	require.Equal(t, 2, strings.Count(err.Error(), "Error 1054"), "the server's refusal, once per connection tried: %v", err)
}
