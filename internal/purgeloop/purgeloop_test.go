package purgeloop_test

import (
	"context"
	"errors"
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

func TestSettingsDefaultsAndValidate(t *testing.T) {
	t.Parallel()
	tooShort := errors.New("too short")
	s := purgeloop.Settings{Horizon: 2 * time.Hour}.WithDefaults(time.Hour, time.Minute, 500)
	require.Equal(t, purgeloop.Settings{Horizon: 2 * time.Hour, MinHorizon: time.Hour, Interval: time.Minute, Jitter: 6 * time.Second, BatchSize: 500}, s)
	require.NoError(t, s.Validate("X", tooShort))
	require.ErrorContains(t, purgeloop.Settings{}.Validate("pkg: X", tooShort), "pkg: X.Horizon")
	require.ErrorIs(t, purgeloop.Settings{Horizon: time.Minute, MinHorizon: time.Hour}.Validate("X", tooShort), tooShort)
	require.ErrorContains(t, purgeloop.Settings{Horizon: time.Hour, BatchSize: -1}.Validate("X", tooShort), "X.BatchSize")
}
