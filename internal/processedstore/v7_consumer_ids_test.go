package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The table of the previous release holds rows of 32,768 consumer names
// (a consumer per tenant, say): nothing limited their number before
// migration 0008. Migrate completes (the consumer ids are integers, and a
// sequence value is drawn only for a name not registered), and consumers
// start.
func TestMigrateCompletesOnATableOfMoreConsumerNamesThanASmallint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	table := schema + ".processed_event"
	s := previousRelease(t, sqldb.Pgx(pool), table)
	_, err := pool.Exec(ctx, `INSERT INTO `+table+` (consumer, event_id, event_at)
SELECT 'tenant-' || i, gen_random_uuid(), now() FROM generate_series(1, 32768) AS i`)
	require.NoError(t, err)

	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)), "Migrate")
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)), "Migrate again")
	require.NoError(t, s.CheckLean(ctx, sqldb.Pgx(pool), "tenant-new"), "a consumer starts")
}

// previousRelease returns a store of table (1 h horizon) with the table
// migrated as the release before migration 0008 left it (migrations 1–7).
func previousRelease(t *testing.T, q sqldb.Querier, table string) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := s.Migrations()
	require.NoError(t, err)
	require.Len(t, ms, 9)
	require.NoError(t, sqldb.Migrate(context.Background(), q, sqldb.PostgreSQL, "processed:"+s.Table().String(), ms[:7]))
	return s
}
