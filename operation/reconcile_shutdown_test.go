package operation_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/operation"
)

// A lookup cut short because the handler's context ended (a shutdown) is no
// verdict on the operation: Do returns a transient error, not an
// UncertainError for the reconciliation topic (RouteUncertain would have
// sent the message to a person and acked it instead of letting the next
// process reconcile it), calls nothing, and leaves the record uncertain for
// the next attempt's lookup.
func TestReconcileInterruptedByShutdownIsNoVerdict(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		k := mustKey(t, "charge", "shutdown")
		p := newProvider()
		p.timeouts = 1
		_, err := e.r.Do(ctx, k, eur100, p.call("100", "EUR"))
		require.ErrorIs(t, err, operation.ErrUncertain)

		cctx, cancel := context.WithCancel(ctx)
		_, err = e.r.Do(cctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(
			func(ctx context.Context, _ operation.Record) (operation.Result, error) {
				cancel() // the process is stopping while the lookup runs
				<-ctx.Done()
				return operation.Result{}, ctx.Err()
			}))
		require.Error(t, err)
		require.True(t, inbox.IsTransient(err), "%v", err)
		require.False(t, operation.NeedsReconciliation(err))
		rec, gerr := e.r.Get(ctx, k)
		require.NoError(t, gerr)
		require.Equal(t, operation.StateUncertain, rec.State)

		res, err := e.r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(p.reconcile))
		require.NoError(t, err)
		require.Equal(t, operation.OriginReconciled, res.Origin)
		charges, calls, _ := p.counts()
		require.Equal(t, 1, charges)
		require.Equal(t, 1, calls)
	})
}
