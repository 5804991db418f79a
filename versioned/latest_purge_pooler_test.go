package versioned_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Behind PgBouncer in transaction pooling, with other clients sharing its
// server connections, a lone family purger runs every time it is asked
// (its lock is transaction-scoped; a session lock leaked to the server
// connection and skipped runs) and purges the idle families (case 27.1).
func TestFamilyPurgerRunsOnScheduleBehindTransactionPooler(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bouncer := testenv.StartPgBouncer(t, "transaction", "default_pool_size = 3")
	admin, schema := testenv.Pool(t)
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{
		LatestTable: schema + ".family_latest", AppliedTable: schema + ".family_applied"})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, idempotency.Pgx(admin)))

	bouncer.OtherClients(t, 4)

	pool := bouncer.PoolBehind(t, pgx.QueryExecModeExec, 2)
	purger, err := versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: 2}, nil)
	require.NoError(t, err)
	skipped := 0
	for run := 0; run < 15; run++ {
		for i := 0; i < 5; i++ {
			_, err := s.Advance(ctx, sqldb.Pgx(admin), versioned.Family{Kind: "k", ID: fmt.Sprint(run*10 + i)}, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
			require.NoError(t, err)
		}
		_, err := admin.Exec(ctx, `UPDATE `+schema+`.family_latest SET updated_at = now() - interval '2 hours'`)
		require.NoError(t, err)
		_, ran, err := purger.PurgeNow(ctx)
		require.NoError(t, err)
		if !ran {
			skipped++
		}
	}
	require.Zero(t, skipped, "runs skipped with no other purger running")
	var left int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.family_latest`).Scan(&left))
	require.Zero(t, left)
}
