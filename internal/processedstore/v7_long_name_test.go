package processedstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// processed.Config.Table allows 63 bytes a part. A table whose name is
// longer than 53 bytes has no UUIDv7 claim table (its siblings' names,
// <name>_v7_mirror the longest, would pass PostgreSQL's 63): it migrates
// and claims in the table as before migration 0008.
func TestMigrateAndClaimOnATableWithAFiftyFiveByteName(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	name := "p" + strings.Repeat("x", 54)
	require.Len(t, name, 55)
	s, err := processedstore.NewStore(processedstore.Config{Table: schema + "." + name, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)), "Migrate")
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)), "Migrate again")
	require.NoError(t, s.CheckLean(ctx, sqldb.Pgx(pool), "stock"))
	ok, err := s.Claim(ctx, sqldb.Pgx(pool), "stock", uuid.Must(uuid.NewV7()))
	require.NoError(t, err)
	require.True(t, ok)
}
