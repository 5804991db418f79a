package outbox_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// On pgx, a read whose statement fails on the server reports the server's
// error, never an empty result: in QueryExecModeExec the error comes back
// with the rows (there is no prepare round trip to fail first), and
// watermill-sql's pgx rows drop it at Close. Replay of a dropped archive
// and the count of a dropped dead-letter table fail with 42P01.
func TestReadsOnPgxReportTheStatementsError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 2)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ob, err := outbox.New(outbox.Config{Table: "ob_read", DB: idempotency.Pgx(pool)}, nil)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	_, err = admin.Exec(ctx, `DROP TABLE ob_read_relayed, ob_read_dead`)
	require.NoError(t, err)

	var pgErr *pgconn.PgError
	_, err = ob.Replay(ctx, wsql.BeginnerFromPgx(pool), nil, outbox.ReplayFilter{
		From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Hour), DryRun: true})
	require.ErrorAs(t, err, &pgErr, "Replay of a dropped archive")
	require.Equal(t, "42P01", pgErr.Code)
	_, err = ob.DeadLetters(ctx)
	require.ErrorAs(t, err, &pgErr, "DeadLetters of a dropped table")
	require.Equal(t, "42P01", pgErr.Code)
}
