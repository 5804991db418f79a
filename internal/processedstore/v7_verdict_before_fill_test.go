package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// An instance of this release started before processed.Migrate filled
// processed_event_v7 (with MigrationsFS; it claims in the table until it
// restarts) meets, after the fill, an event another instance of the same
// consumer applied in processed_event_v7; a redelivery of it past the
// horizon is refused by both, and is a duplicate for both: never reported
// as expired (dead-lettered) by the one and as a duplicate by the other.
func TestConsumerStartedBeforeTheFillReportsAnEventAppliedInTheV7TableAsADuplicate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	table := schema + ".processed_event"
	owner, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := owner.Migrations()
	require.NoError(t, err)
	// goose / golang-migrate: every migration, no fill yet.
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+owner.Table().String(), ms))
	early, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, early.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	require.NoError(t, owner.Migrate(ctx, sqldb.Pgx(pool))) // the fill: ready
	late, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, late.CheckLean(ctx, sqldb.Pgx(pool), "stock"))

	// Applied by the late instance two hours ago, when it was within the
	// horizon (its claim, in processed_event_v7).
	id := v7At(dbNow(t, pool).Add(-2 * time.Hour))
	_, err = pool.Exec(ctx, `INSERT INTO processed_event_v7 (consumer, event_id) SELECT id, $1 FROM processed_event_consumer WHERE name = 'stock'`, id)
	require.NoError(t, err)

	// Redelivered now, past the horizon.
	claimed, err := late.ClaimAt(ctx, sqldb.Pgx(pool), "stock", id, time.Time{})
	require.False(t, claimed)
	require.NoError(t, err, "a duplicate for the instance in v7 mode")
	claimed, err = early.ClaimAt(ctx, sqldb.Pgx(pool), "stock", id, time.Time{})
	assert.False(t, claimed)
	assert.NoError(t, err, "a duplicate for the instance started before the fill too")
	done, err := early.Processed(ctx, sqldb.Pgx(pool), "stock", id)
	require.NoError(t, err)
	assert.True(t, done, "processed, for the instance started before the fill")
}
