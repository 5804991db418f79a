package processedstore_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A consumer's role needs SELECT and INSERT on the processed table (the
// claim is an INSERT … ON CONFLICT DO NOTHING, the reads SELECTs); the
// purge runs as another role, with DELETE. Granted migration 0008's new
// tables too, the consumer starts on the UUIDv7 claim table and finds the
// events it claimed through the table before. Granted the table alone,
// it starts too and claims in the table, whose trigger (run as the
// tables' owner) copies its claims: an event it claims is a duplicate for
// the other.
func TestConsumerRoleWithInsertAndSelectOnTheTableStartsOnTheV7Table(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, admin, owner := appServer(t)
	schema, table := "app", "app.processed_event"
	// Events the consumer processed through the table before its name was
	// registered (a consumer of the previous release).
	var ids []uuid.UUID
	for i := 0; i < 3; i++ {
		id := uuid.Must(uuid.NewV7())
		ok, err := owner.Claim(ctx, sqldb.Pgx(admin), "stock", id)
		require.NoError(t, err)
		require.True(t, ok)
		ids = append(ids, id)
	}
	for _, stmt := range []string{
		`CREATE ROLE consumer LOGIN`,
		`GRANT USAGE ON SCHEMA app TO consumer`,
		`GRANT SELECT, INSERT ON app.processed_event TO consumer`,
		`GRANT ALL ON app.processed_event_horizon, app.processed_event_handler, app.processed_event_crash,
			app.processed_event_consumer, app.processed_event_v7, app.processed_event_v7_ready TO consumer`,
		`GRANT ALL ON ALL SEQUENCES IN SCHEMA app TO consumer`,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	u, err := url.Parse(pg.URL)
	require.NoError(t, err)
	u.User = url.User("consumer")
	pool := testenv.PoolAt(t, u.String(), schema, 4)

	s, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	assert.NoError(t, s.CheckLean(ctx, sqldb.Pgx(pool), "stock"), "the consumer starts")
	// Restarted (a crash loop of its pod, or the next deploy).
	s, err = processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.CheckLean(ctx, sqldb.Pgx(pool), "stock"), "the consumer restarts")
	for _, id := range ids {
		done, err := s.Processed(ctx, sqldb.Pgx(pool), "stock", id)
		require.NoError(t, err)
		require.True(t, done, "event %s processed before", id)
	}

	for _, stmt := range []string{
		`CREATE ROLE narrow LOGIN`,
		`GRANT USAGE ON SCHEMA app TO narrow`,
		`GRANT SELECT, INSERT ON app.processed_event TO narrow`,
		`GRANT ALL ON app.processed_event_horizon, app.processed_event_handler, app.processed_event_crash TO narrow`,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	u.User = url.User("narrow")
	narrowPool := testenv.PoolAt(t, u.String(), schema, 4)
	n, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, n.CheckLean(ctx, sqldb.Pgx(narrowPool), "stock"), "starts without the new tables' grants")
	id := uuid.Must(uuid.NewV7())
	p, ok := n.ClaimParamsAt("stock", id, time.Time{}, nil)
	require.True(t, ok)
	require.Zero(t, p.ConsumerID, "claims in the table")
	claimed, err := n.Claim(ctx, sqldb.Pgx(narrowPool), "stock", id)
	require.NoError(t, err)
	require.True(t, claimed)
	require.False(t, claimV7(t, pool, s, "stock", id), "a duplicate in the UUIDv7 claim table")
}

// appServer starts a private server (roles are the server's) whose table
// app.processed_event is migrated by its owner, and returns it, a pool of
// the owner and the owner's store.
func appServer(t *testing.T) (*testenv.Postgres, *pgxpool.Pool, *processedstore.Store) {
	t.Helper()
	ctx := context.Background()
	pg := testenv.StartPostgres(t)
	admin := testenv.PoolAt(t, pg.URL, "public", 4)
	_, err := admin.Exec(ctx, `CREATE SCHEMA app`)
	require.NoError(t, err)
	owner, err := processedstore.NewStore(processedstore.Config{Table: "app.processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, owner.Migrate(ctx, sqldb.Pgx(admin)))
	return pg, admin, owner
}
