package processedstore_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// processedLayouts are the table layouts README allows for processed_event,
// each as the DDL that replaces the migration's CREATE TABLE (the migrations
// then add what is missing: indexes, later columns). The column list is taken
// from a template table created by the store's own migrations, so the test
// follows the schema.
var processedLayouts = map[string]string{
	"plain": `CREATE TABLE processed_event (LIKE tpl.processed_event INCLUDING DEFAULTS, PRIMARY KEY (consumer, event_id))`,
	"hash": `CREATE TABLE processed_event (LIKE tpl.processed_event INCLUDING DEFAULTS, PRIMARY KEY (consumer, event_id)) PARTITION BY HASH (event_id);
		CREATE TABLE processed_event_h0 PARTITION OF processed_event FOR VALUES WITH (MODULUS 4, REMAINDER 0);
		CREATE TABLE processed_event_h1 PARTITION OF processed_event FOR VALUES WITH (MODULUS 4, REMAINDER 1);
		CREATE TABLE processed_event_h2 PARTITION OF processed_event FOR VALUES WITH (MODULUS 4, REMAINDER 2);
		CREATE TABLE processed_event_h3 PARTITION OF processed_event FOR VALUES WITH (MODULUS 4, REMAINDER 3)`,
	"range": `CREATE TABLE processed_event (LIKE tpl.processed_event INCLUDING DEFAULTS, PRIMARY KEY (consumer, event_id)) PARTITION BY RANGE (consumer);
		CREATE TABLE processed_event_r0 PARTITION OF processed_event FOR VALUES FROM (MINVALUE) TO ('c2');
		CREATE TABLE processed_event_r1 PARTITION OF processed_event FOR VALUES FROM ('c2') TO ('c3');
		CREATE TABLE processed_event_r2 PARTITION OF processed_event FOR VALUES FROM ('c3') TO (MAXVALUE)`,
}

// On every layout the purge deletes exactly the rows outside the horizon.
// Keyed by ctid (the code before this test), a hash- or range-partitioned
// table lost rows inside the horizon: ctids repeat across partitions.
func TestPurgeEveryLayoutDeletesOnlyExpiredRows(t *testing.T) {
	t.Parallel()
	for name, ddl := range processedLayouts {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, schema := testenv.Pool(t)
			ctx := context.Background()
			_ = schema
			tpl := testenv.Schema(t) // a template table made by the migrations
			tplStore, err := processedstore.NewStore(processedstore.Config{Table: tpl + ".processed_event"})
			require.NoError(t, err)
			require.NoError(t, tplStore.Migrate(ctx, sqldb.Pgx(pool)))
			_, err = pool.Exec(ctx, strings.ReplaceAll(ddl, "tpl.", tpl+"."))
			require.NoError(t, err)
			s := newStore(t, sqldb.Pgx(pool))

			// 3 consumers × 100 expired rows and × 100 rows inside the
			// horizon, spread over every partition.
			var fresh []uuid.UUID
			for c := 1; c <= 3; c++ {
				for i := 0; i < 200; i++ {
					id := uuid.Must(uuid.NewV7())
					ok, err := s.Claim(ctx, sqldb.Pgx(pool), fmt.Sprintf("c%d", c), id)
					require.NoError(t, err)
					require.True(t, ok)
					if (i+c)%2 == 0 { // interleaved differently per consumer
						ageRow(t, pool, fmt.Sprintf("c%d", c), id, 2*time.Hour)
					} else {
						fresh = append(fresh, id)
					}
				}
			}
			p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour, BatchSize: 70}, nil)
			require.NoError(t, err)
			n, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran)
			require.EqualValues(t, 300, n)
			var left int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_id = ANY($1)`, fresh).Scan(&left))
			require.Equal(t, len(fresh), left, "every row inside the horizon stays")
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&left))
			require.Equal(t, 300, left)
		})
	}
}

// ageRow moves one row's times back by d, as if it had been processed d ago.
func ageRow(t *testing.T, pool *pgxpool.Pool, consumer string, id uuid.UUID, d time.Duration) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `UPDATE processed_event SET event_at = event_at - $3::bigint * interval '1 microsecond'
		WHERE consumer = $1 AND event_id = $2`, consumer, id, d.Microseconds())
	require.NoError(t, err)
}
