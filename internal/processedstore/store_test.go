package processedstore_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

func newStore(t *testing.T, db sqldb.Querier) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(context.Background(), db))
	return s
}

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	s, err := processedstore.NewStore(processedstore.Config{Table: schema + ".inbox"})
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			other := testenv.PoolOn(t, schema, 2)
			errs <- s.Migrate(context.Background(), sqldb.Pgx(other))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, s.Migrate(context.Background(), sqldb.Pgx(pool)))
	var cols []string
	rows, err := pool.Query(context.Background(),
		`SELECT column_name || ':' || data_type FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'inbox' ORDER BY ordinal_position`, schema)
	require.NoError(t, err)
	for rows.Next() {
		var c string
		require.NoError(t, rows.Scan(&c))
		cols = append(cols, c)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"consumer:text", "event_id:uuid", "processed_at:timestamp with time zone", "event_at:timestamp with time zone", "event_name:text", "fingerprint:bytea"}, cols)
	var idx int
	require.NoError(t, pool.QueryRow(context.Background(),
		// Catalog columns only (pg_indexes evaluates pg_get_indexdef on
		// other tests' indexes, which fails on one dropped meanwhile).
		`SELECT count(*) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = i.relnamespace JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = x.indkey[0]
WHERE n.nspname = $1 AND t.relname = 'inbox' AND x.indnkeyatts = 1 AND a.attname = 'event_at'`, schema).Scan(&idx))
	require.Equal(t, 1, idx)
	var recorded int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM idempotency_migration WHERE component = $1`, "processed:"+schema+".inbox").Scan(&recorded))
	require.Equal(t, 9, recorded, "versions 1 to 9, each recorded once, next to the table")
}

func TestConfigValidateNamesField(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{`x"; DROP TABLE y; --`, "a.b.c", "1abc", "a-b", "sch.", "tab le"} {
		_, err := processedstore.NewStore(processedstore.Config{Table: bad})
		require.ErrorContains(t, err, "Config.Table", bad)
	}
	s, err := processedstore.NewStore(processedstore.Config{Table: "inbox.processed_event"})
	require.NoError(t, err)
	q, _ := s.ClaimQuery("c", uuid.New())
	require.Equal(t, `INSERT INTO "inbox"."processed_event" (consumer, event_id, event_at) VALUES ($1, $2, coalesce($3::timestamptz, now())) ON CONFLICT DO NOTHING`, q)
}

func TestPurgeBatch(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	db := sqldb.Pgx(pool)
	s := newStore(t, db)
	// 5 rows 2h old, 3 rows 30 minutes old; horizon 1h.
	for i := 0; i < 8; i++ {
		age := "2 hours"
		if i >= 5 {
			age = "30 minutes"
		}
		_, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO processed_event (consumer, event_id, event_at) VALUES ('c', $1, now() - interval '%s')`, age), uuid.Must(uuid.NewV7()))
		require.NoError(t, err)
	}
	n, err := s.PurgeBatch(ctx, db, time.Hour, 2)
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "bounded by the batch size")
	n, err = s.PurgeBatch(ctx, db, time.Hour, 100)
	require.NoError(t, err)
	require.EqualValues(t, 3, n)
	var left int
	require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM processed_event").Scan(&left))
	require.Equal(t, 3, left)
}

func mustV7(t *testing.T) uuid.UUID {
	t.Helper()
	id, err := uuid.NewV7()
	require.NoError(t, err)
	return id
}
