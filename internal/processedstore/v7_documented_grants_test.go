package processedstore_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Roles granted what docs/retention.md says for migration 8: a consumer
// role (SELECT, INSERT on <table>_v7 and <table>_consumer, SELECT on
// <table>_v7_ready, besides what it needed before) starts on the UUIDv7
// claim table; a purger role (SELECT, UPDATE, DELETE on <table>_v7 and
// SELECT on <table>_consumer, besides SELECT, UPDATE, DELETE on the table)
// purges both tables. A purger role granted only what it needed before
// still purges the table (and logs that it may not purge the other).
func TestRolesGrantedAsDocumentedForMigration8StartAndPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, admin, owner := appServer(t)
	table := "app.processed_event"
	_, _, err := owner.AdoptHorizon(ctx, sqldb.Pgx(admin), time.Hour, time.Now().Add(-48*time.Hour))
	require.NoError(t, err)
	for _, stmt := range []string{
		`CREATE ROLE consumer LOGIN`,
		`CREATE ROLE purger LOGIN`,
		`GRANT USAGE ON SCHEMA app TO consumer, purger`,
		// What a consumer and a purger needed before migration 8.
		`GRANT SELECT, INSERT ON app.processed_event TO consumer`,
		`GRANT SELECT, UPDATE, DELETE ON app.processed_event TO purger`,
		`GRANT ALL ON app.processed_event_horizon, app.processed_event_handler, app.processed_event_crash TO consumer, purger`,
		// Migration 8, as retention.md says.
		`GRANT SELECT, INSERT ON app.processed_event_v7, app.processed_event_consumer TO consumer`,
		`GRANT SELECT ON app.processed_event_v7_ready TO consumer`,
		`GRANT SELECT, UPDATE, DELETE ON app.processed_event_v7 TO purger`,
		`GRANT SELECT ON app.processed_event_consumer TO purger`,
		`CREATE ROLE narrow LOGIN`,
		`GRANT USAGE ON SCHEMA app TO narrow`,
		`GRANT SELECT, UPDATE, DELETE ON app.processed_event TO narrow`,
		`GRANT ALL ON app.processed_event_horizon, app.processed_event_handler, app.processed_event_crash TO narrow`,
	} {
		_, err := admin.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	u, err := url.Parse(pg.URL)
	require.NoError(t, err)

	u.User = url.User("consumer")
	cpool := testenv.PoolAt(t, u.String(), "app", 4)
	s, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	if assert.NoError(t, s.CheckLean(ctx, sqldb.Pgx(cpool), "stock"), "the consumer starts") {
		p, ok := s.ClaimParamsAt("stock", uuid.Must(uuid.NewV7()), time.Time{}, nil)
		require.True(t, ok)
		assert.NotZero(t, p.ConsumerID, "on the UUIDv7 claim table")
	}

	// An expired row in each table.
	old := v7At(dbNow(t, admin).Add(-3 * time.Hour))
	_, err = admin.Exec(ctx, `INSERT INTO app.processed_event (consumer, event_id, event_at) VALUES ('stock', $1, now() - interval '3 hours')`, uuid.New())
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `INSERT INTO app.processed_event_v7 (consumer, event_id) SELECT id, $1 FROM app.processed_event_consumer WHERE name = 'stock'`, old)
	require.NoError(t, err)

	u.User = url.User("narrow")
	npool := testenv.PoolAt(t, u.String(), "app", 4)
	ns, err := processedstore.NewStore(processedstore.Config{Table: table})
	require.NoError(t, err)
	np, err := processedstore.NewPurger(ns, sqldb.PgxPool(npool), processedstore.PurgerConfig{FromTable: true, BatchSize: 100}, nil)
	require.NoError(t, err)
	n, _, err := np.PurgeNow(ctx)
	require.NoError(t, err, "the table is purged")
	require.EqualValues(t, 1, n)
	_, err = admin.Exec(ctx, `INSERT INTO app.processed_event (consumer, event_id, event_at) VALUES ('stock', $1, now() - interval '3 hours')`, uuid.New())
	require.NoError(t, err)

	u.User = url.User("purger")
	ppool := testenv.PoolAt(t, u.String(), "app", 4)
	ps, err := processedstore.NewStore(processedstore.Config{Table: table})
	require.NoError(t, err)
	p, err := processedstore.NewPurger(ps, sqldb.PgxPool(ppool), processedstore.PurgerConfig{FromTable: true, BatchSize: 100}, nil)
	require.NoError(t, err)
	n, _, err = p.PurgeNow(ctx)
	assert.NoError(t, err, "the purger purges")
	assert.EqualValues(t, 2, n)
}
