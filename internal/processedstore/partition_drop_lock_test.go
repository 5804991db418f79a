package processedstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// An expired partition held by an open transaction (a long read of it) is
// not dropped by that run: the drop waits at most 2 s for its lock, so
// claims never queue behind it for longer, the run goes on, and the next
// run, once the transaction has ended, drops it.
func TestPartitionDropGivesUpOnAHeldPartition(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := partitionedStore(t, time.Hour, 2*time.Hour)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	old := dbNow(t, pool).UTC().Truncate(time.Hour).Add(-5 * time.Hour)
	name := "processed_event_p" + old.Format("200601021504")
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
		name, bound(old), bound(old.Add(time.Hour))))
	require.NoError(t, err)

	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT count(*) FROM `+name)
	require.NoError(t, err)

	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, time.Minute) // a drop that waited for the holder would end the run here
	defer cancel()
	_, ran, err := p.PurgeNow(runCtx)
	require.NoError(t, err, "the run gives up the drop, not its context")
	require.True(t, ran)
	require.Contains(t, partitionNames(t, pool), name, "the held partition stays until the next run")

	require.NoError(t, holder.Rollback(ctx))
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
	require.NotContains(t, partitionNames(t, pool), name)
}

// partitionNames lists the partitions of processed_event.
func partitionNames(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	var names []string
	rows, err := pool.Query(context.Background(), `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'processed_event'::regclass`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		names = append(names, n)
	}
	require.NoError(t, rows.Err())
	return names
}
