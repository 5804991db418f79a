package processedstore_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The purge's DELETE on PostgreSQL never runs with JIT compilation. The
// planner prices its per-consumer arm for a hundred consumers, above the
// default jit_above_cost on a table of twenty thousand rows already, and
// every batch compiled it: 0.2 to 1.5 s a batch of 1,000 rows, so a
// backlog of millions of rows was purged at a few thousand rows a second.
// The purger's sessions here log each statement's plan (auto_explain, as
// notices to the client) and would JIT anything (jit_above_cost 0).
func TestPurgeBatchesRunWithoutJIT(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	var super bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super))
	require.True(t, super, "auto_explain needs a superuser session")
	s := newStore(t, sqldb.Pgx(pool)) // horizon 1 h
	_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
		SELECT 'c', gen_random_uuid(), now() - interval '3 days' FROM generate_series(1, 30)`)
	require.NoError(t, err)

	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 2)
	for k, v := range map[string]string{"session_preload_libraries": "auto_explain", "auto_explain.log_min_duration": "0",
		"auto_explain.log_level": "notice", "jit_above_cost": "0"} {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	var (
		mu    sync.Mutex
		plans []string
	)
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if strings.Contains(n.Message, "Delete on") {
			mu.Lock()
			plans = append(plans, n.Message)
			mu.Unlock()
		}
	}
	purgerPool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer purgerPool.Close()
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(purgerPool), processedstore.PurgerConfig{Horizon: time.Hour, BatchSize: 10}, nil)
	require.NoError(t, err)
	n, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	require.EqualValues(t, 30, n)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, plans, 8, "two plans a batch, the table's and processed_event_v7's: 10, 10, 10, 0 rows")
	for _, plan := range plans {
		require.NotContains(t, plan, "JIT:", "a purge batch was compiled:\n%s", plan)
	}
}
