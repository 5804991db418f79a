package operation_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
)

// The attempt's session ends after its begin committed and before its
// call: the fence right before the call fails on the broken connection and
// Do returns a transient error without calling. The provider certainly did
// nothing, so the retry must call (as after a cancelled context, which
// releases the key), not find a started record of a "dead" owner and turn
// it into an uncertain outcome that only a person (Resolve) or a reconcile
// function can settle. Not parallel: the crash-point hook is the process's.
func TestFenceFailureBeforeCallLeavesKeyCallable(t *testing.T) {
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	r, _ := pgRunner(t, schema, 2, map[string]string{"application_name": "fence-broken"})
	key := mustKey(t, "charge", "fence-broken")
	var once sync.Once
	crashpoint.Set(func(name string) {
		if name == operation.CrashAfterBegin {
			once.Do(func() {
				_, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'fence-broken'`)
				require.NoError(t, err)
				eventually(t, "the attempt's lock to go with its session", func(o *testenv.Observed) bool {
					return !o.Bool("held", lockHeld(t, admin, r, key))
				})
			})
		}
	})
	t.Cleanup(func() { crashpoint.Set(nil) })
	calls := 0
	call := func(context.Context, string) (operation.Result, error) {
		calls++
		return operation.Result{Reference: "charged"}, nil
	}
	_, err := r.Do(ctx, key, eur100, call)
	require.Error(t, err)
	require.True(t, middleware.IsTransient(err), "%v", err)
	require.Zero(t, calls, "not called: the fence failed")

	var res operation.Result
	eventually(t, "the retry to get past the first attempt", func(o *testenv.Observed) bool {
		res, err = r.Do(ctx, key, eur100, call)
		var ip *operation.InProgressError
		return !errors.As(err, &ip) || o.Err("do", err)
	})
	var ue *operation.UncertainError
	require.False(t, errors.As(err, &ue), "an operation certainly never called became uncertain: %v", err)
	require.NoError(t, err)
	require.Equal(t, "charged", res.Reference)
	require.Equal(t, 1, calls)
}
