package operation_test

import (
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// Environment of the crash child (TestCrashChild).
const (
	envCrashTarget   = "OPERATION_CRASH_TARGET"
	envCrashDatabase = "OPERATION_CRASH_DATABASE"
	envCrashProvider = "OPERATION_CRASH_PROVIDER"
	envCrashPoint    = "OPERATION_CRASH_POINT"
)

// TestCrashChild is the child process of the crash tests, not a test of its
// own: without its environment it returns at once. It runs one Do against the
// parent's provider and SIGKILLs itself at the named crash point.
func TestCrashChild(t *testing.T) {
	target, database := os.Getenv(envCrashTarget), os.Getenv(envCrashDatabase)
	if target == "" {
		return
	}
	point := os.Getenv(envCrashPoint)
	crashpoint.Set(func(name string) {
		if name == point {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	})
	r := runnerOn(t, testenv.OpenTarget(t, target, database, 2), operation.Config{}).r
	hp := httpProvider{base: os.Getenv(envCrashProvider)}
	_, err := r.Do(context.Background(), operation.MustKey("charge", "p-1"),
		map[string]any{"amount": 100, "currency": "EUR"}, hp.call("100", "EUR"))
	t.Fatalf("the child was not killed at %s (Do returned %v)", point, err)
}

// runCrashChild runs TestCrashChild in a child process on e's database and
// checks that it died by SIGKILL.
func runCrashChild(t *testing.T, e *runnerEnv, providerURL, point string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashTarget+"="+e.Name, envCrashDatabase+"="+e.Database,
		envCrashProvider+"="+providerURL, envCrashPoint+"="+point)
	out, err := cmd.CombinedOutput()
	require.Error(t, err, "child output:\n%s", out)
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child did not die by SIGKILL: %v\n%s", err, out)
}

// The process dies after the provider accepted the charge and before the
// success was recorded. The record stays started with a dead owner; the next
// attempt does not call again on a guess: without a reconcile function it is
// an uncertain error for reconciliation, with one it looks the key up and
// records the charge. One charge in all.
func TestCrashAfterProviderAccepted(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		srv := httptest.NewServer(p)
		t.Cleanup(srv.Close)
		key := operation.MustKey("charge", "p-1")
		params := map[string]any{"amount": 100, "currency": "EUR"}
		hp := httpProvider{base: srv.URL}

		runCrashChild(t, e, srv.URL, operation.CrashAfterCall)
		waitLease(t, e)
		charges, calls, _ := p.counts()
		require.Equal(t, 1, charges, "the provider accepted the charge")
		require.Equal(t, 1, calls)
		rec, err := r.Get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, operation.StateStarted, rec.State, "the outcome was never recorded")
		require.NotEmpty(t, rec.Owner)

		// No reconcile function: uncertain, for a person; nothing called.
		_, err = r.Do(ctx, key, params, hp.call("100", "EUR"))
		var u *operation.UncertainError
		require.ErrorAs(t, err, &u)
		require.Equal(t, "charge:p-1", u.Key)
		require.True(t, inbox.IsPermanent(err))
		rec, err = r.Get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, operation.StateUncertain, rec.State)

		// With the lookup by key: reconciled, recorded, one charge.
		res, err := r.Do(ctx, key, params, hp.call("100", "EUR"), operation.WithReconcile(hp.reconcile))
		require.NoError(t, err)
		require.Equal(t, operation.OriginReconciled, res.Origin)
		require.Equal(t, "ch_1", res.Reference)
		charges, calls, lookups := p.counts()
		require.Equal(t, 1, charges)
		require.Equal(t, 1, calls)
		require.Equal(t, 1, lookups)
		rec, err = r.Get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, operation.StateSucceeded, rec.State)
		require.Equal(t, "ch_1", rec.Reference)
	})
}

// The process dies after the started record was committed and before the
// provider was called: the next attempt cannot know that, so it reconciles;
// the lookup finds nothing and it calls, with the same key. One charge.
func TestCrashBeforeProviderCalled(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		srv := httptest.NewServer(p)
		t.Cleanup(srv.Close)
		key := operation.MustKey("charge", "p-1")
		hp := httpProvider{base: srv.URL}

		runCrashChild(t, e, srv.URL, operation.CrashAfterBegin)
		waitLease(t, e)
		_, calls, _ := p.counts()
		require.Zero(t, calls)

		res, err := r.Do(ctx, key, map[string]any{"amount": 100, "currency": "EUR"}, hp.call("100", "EUR"),
			operation.WithReconcile(hp.reconcile))
		require.NoError(t, err)
		require.Equal(t, operation.OriginCall, res.Origin)
		charges, calls, lookups := p.counts()
		require.Equal(t, 1, charges)
		require.Equal(t, 1, calls)
		require.Equal(t, 1, lookups)
		require.Equal(t, []string{"lookup charge:p-1", "charge charge:p-1"}, p.seenKeys())
	})
}

// waitLease waits until the dead child's lease on its started record ran
// out (operation.LeaseDuration after it last renewed it): until then its
// owner is presumed alive and the next attempt is in progress elsewhere.
func waitLease(t *testing.T, e *runnerEnv) {
	t.Helper()
	if e.Dialect == sqldb.SQLite {
		return // the lock is the process's: no lease
	}
	time.Sleep(operation.LeaseDuration() + 100*time.Millisecond)
}
