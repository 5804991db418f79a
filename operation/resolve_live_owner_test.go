package operation_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
)

// Resolve "never moves a record under a live owner". An owner whose session
// ended during its call (idle_session_timeout) keeps renewing its lease:
// Do then answers InProgressError, and Resolve must too. Otherwise an
// operator's VerdictNotExecuted gives the key back while the first call
// runs, the next Do calls the provider a second time, and the first
// attempt's success is lost (ErrLostOwnership).
func TestResolveRefusesLiveOwnerWhoseSessionEnded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	first, _ := pgRunner(t, schema, 2, map[string]string{"idle_session_timeout": "200ms"})
	second, _ := pgRunner(t, schema, 2, nil)
	key := mustKey(t, "charge", "resolve-live")
	var calls atomic.Int32
	var resolveErr, secondErr error
	call := func(ctx context.Context, k string) (operation.Result, error) {
		if calls.Add(1) > 1 {
			return operation.Result{Reference: "again"}, nil
		}
		eventually(t, "the idle session to end and its lock with it", func(o *testenv.Observed) bool {
			return !o.Bool("held", lockHeld(t, admin, first, key))
		})
		resolveErr = second.Resolve(ctx, key, operation.VerdictNotExecuted("operator: no trace at the provider"))
		if resolveErr == nil {
			_, secondErr = second.Do(ctx, key, eur100, func(context.Context, string) (operation.Result, error) {
				calls.Add(1)
				return operation.Result{Reference: "second"}, nil
			})
		}
		return operation.Result{Reference: "first"}, nil
	}
	res, err := first.Do(ctx, key, eur100, call)
	for i := 0; err != nil && calls.Load() == 0 && middleware.IsTransient(err) && i < 10; i++ {
		res, err = first.Do(ctx, key, eur100, call) // a pooled session that idled out before the Do
	}
	var ip *operation.InProgressError
	require.ErrorAs(t, resolveErr, &ip, "Resolve moved a record whose owner's lease is live (second Do: %v)", secondErr)
	require.NoError(t, err)
	require.Equal(t, "first", res.Reference)
	require.EqualValues(t, 1, calls.Load(), "the provider is called once")
}
