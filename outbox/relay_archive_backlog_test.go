package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// With Retention the archive is bounded: a backlog of expired archive rows
// (a relay that was down a while, a retention shortened) is purged even
// when deleting all of it takes longer than one database step's deadline
// (2 × PublishTimeout: 500 ms here for a million rows, 20 s by default for a
// busy service's day). The purge goes in bounded batches that each fit it.
func TestRelayPurgesAnArchiveBacklogLargerThanOneStepDeadline(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 4)
	b := newBox(t, tg)
	ctx := context.Background()
	_, err := tg.Pgx.Exec(ctx, `INSERT INTO `+b.table+`_relayed (id, event_id, topic, payload, metadata, created_at_us, relayed_at_us)
		SELECT g, 'e' || g, 'events', '\x7b7d'::bytea, '{}', 1, 1 FROM generate_series(1, 1000000) g`)
	require.NoError(t, err)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	b.relay(t, &sink{}, outbox.RelayConfig{Retention: time.Hour, StatsInterval: 50 * time.Millisecond, PublishTimeout: 250 * time.Millisecond})
	archived := func() int {
		var n int
		require.NoError(t, tg.Pgx.QueryRow(ctx, `SELECT count(*) FROM `+b.table+`_relayed`).Scan(&n))
		return n
	}
	deadline := time.Now().Add(60 * time.Second)
	for archived() > 0 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	var purgeErrs int
	var last string
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		if e.Msg == "outbox archive purge" {
			purgeErrs++
			last = fmt.Sprint(e.Err)
		}
	}
	require.Zero(t, archived(), "expired archive rows left after a minute (%d failed purges, last: %s)", purgeErrs, last)
}
