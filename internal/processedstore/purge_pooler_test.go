package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Behind PgBouncer in transaction pooling, with other clients sharing its
// server connections, a lone purger runs every time it is asked: its lock
// is transaction-scoped, so it neither stays on a server connection after
// the run (a session lock's unlock may run on another one, and the leaked
// lock then skipped 9 to 12 of 15 runs) nor is taken on one connection and
// released on another (case 27.1). Each run deletes its expired rows.
func TestPurgerRunsOnScheduleBehindTransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bouncer := testenv.StartPgBouncer(t, "transaction", "default_pool_size = 3")
	admin, schema := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))

	// Other clients of the pooler: short transactions that keep its server
	// connections changing hands.
	bouncer.OtherClients(t, 4)

	pool := bouncer.PoolBehind(t, pgx.QueryExecModeExec, 2)
	purger, err := processedstore.NewPurger(store, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour, BatchSize: 4}, nil)
	require.NoError(t, err)
	skipped, deleted := 0, int64(0)
	for run := 0; run < 15; run++ {
		for i := 0; i < 10; i++ {
			_, err := admin.Exec(ctx, `INSERT INTO `+schema+`.processed_event (consumer, event_id, event_at) VALUES ('c', $1, now() - interval '2 hours')`, uuid.New())
			require.NoError(t, err)
		}
		n, ran, err := purger.PurgeNow(ctx)
		require.NoError(t, err)
		deleted += n
		if !ran {
			skipped++
		}
	}
	require.Zero(t, skipped, "runs of 15 skipped with no other purger running")
	require.EqualValues(t, 150, deleted)
}
