package purgeloop_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/purgeloop"
)

func TestLoopRunsUntilStopped(t *testing.T) {
	t.Parallel()
	var runs atomic.Int32
	l := purgeloop.New(func(ctx context.Context) (int64, bool, error) {
		runs.Add(1)
		return 1, true, nil
	}, time.Millisecond, time.Millisecond, watermill.NopLogger{}, "things", nil)
	require.NoError(t, l.Start(context.Background()))
	require.ErrorIs(t, l.Start(context.Background()), purgeloop.ErrStarted)
	require.Eventually(t, func() bool { return runs.Load() >= 3 }, 5*time.Second, time.Millisecond)
	l.Stop()
	after := runs.Load()
	l.Stop() // idempotent
	require.Equal(t, after, runs.Load(), "no run after Stop returned")

	// A stopped loop starts again; a cancelled parent context stops it too.
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, l.Start(ctx))
	require.Eventually(t, func() bool { return runs.Load() > after }, 5*time.Second, time.Millisecond)
	cancel()
	l.Stop()
}
