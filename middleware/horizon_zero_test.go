package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A consumer left at ReplayHorizon 0 ("adopts the table's horizon; a table
// that keeps none refuses nothing") on a table that keeps none must leave it
// keeping none: processed.ReplayHorizon reads 0 "when none", so a later
// consumer configured with a horizon (the README's 7 days) on that table is
// one "the table keeps none" for, and NewConsumer records its value. It is
// refused instead with ErrHorizonMismatch ("table … keeps 0s, configured
// 168h0m0s"): the first consumer wrote 0 as the table's horizon.
func TestConsumerHorizonZeroDoesNotPinTheTable(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()

	cfg := e.config("stock") // ReplayHorizon 0: adopt the table's (it keeps none)
	_, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	got, err := processed.ReplayHorizon(ctx, e.db, "")
	require.NoError(t, err)
	require.Zero(t, got, "the table still keeps none")

	cfg.ReplayHorizon = 7 * 24 * time.Hour
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err, "the table keeps none: NewConsumer records the configured horizon")
	got, err = processed.ReplayHorizon(ctx, e.db, "")
	require.NoError(t, err)
	require.Equal(t, 7*24*time.Hour, got)
}
