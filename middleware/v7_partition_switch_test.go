package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A consumer on the plain layout claims UUIDv7 events in
// processed_event_v7 (migration 0008). processed.MigrateToPartitioned
// folds that table into the legacy table while the consumer runs: the
// consumer's next attempt fails once (no such table), and every later one
// claims in the table as before. No event is applied twice, by it or by a
// consumer started with the partitioned layout, whichever sees it first.
func TestPlainConsumerOfTheV7TableKeepsApplyingOnceAcrossThePartitionSwitch(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	cfg := e.config("stock")
	var calls atomic.Int32
	handler := effectHandler(&calls)
	plain, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	hp, err := door.Wrap(plain, "reserve", handler)
	require.NoError(t, err)
	before := newEvent(t)
	_, err = hp(before)
	require.NoError(t, err)
	var inV7 int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_v7 WHERE event_id = $1`, before.UUID).Scan(&inV7))
	require.Equal(t, 1, inV7, "claimed in the v7 table")

	require.NoError(t, processed.MigrateToPartitioned(ctx, e.db, processed.Config{}))
	var left *string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT to_regclass('processed_event_v7')::text`).Scan(&left))
	require.Nil(t, left, "folded into the legacy table")

	// The plain consumer still running: at most one failed attempt, then
	// a duplicate.
	failed := 0
	for {
		if _, err = hp(before.Copy()); err == nil {
			break
		}
		t.Logf("attempt after the switch: %v", err)
		failed++
		require.LessOrEqual(t, failed, 1)
	}
	require.Equal(t, int32(1), calls.Load())
	// A new event applied once by it, a duplicate for the partitioned one.
	after := newEvent(t)
	_, err = hp(after)
	require.NoError(t, err)
	cfg.Layout = processed.LayoutPartitioned
	part, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	hq, err := door.Wrap(part, "reserve", handler)
	require.NoError(t, err)
	for _, m := range []string{before.UUID, after.UUID} {
		msg := newEvent(t)
		msg.UUID = m
		_, err = hq(msg)
		require.NoError(t, err)
	}
	require.Equal(t, int32(2), calls.Load(), "each event applied once")
	var effects int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 2, effects)
}
