package inbox_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// v7ModeAttempt returns one attempt (no retry chain) of consumer "stock"
// on a store in v7 mode (schema-qualified, <table>_v7 ready), through
// beginner, whose handler notes an effect row.
func v7ModeAttempt(t *testing.T, q sqldb.Querier, table string, beginner inbox.TxBeginner) (func(uuid.UUID) error, *processedstore.Store) {
	t.Helper()
	store, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.CheckLean(context.Background(), q, "stock"))
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		qq, _ := inbox.QuerierFromContext(msg.Context())
		_, err := qq.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	return func(id uuid.UUID) error {
		_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
		return err
	}, store
}

// A consumer on database/sql, or on pgx without the prepared claim (a
// pool not in QueryExecModeCacheStatement), on a store in v7 mode: its
// claims and its commit guard use processed_event_v7. MigrateToPartitioned
// folds that table away while it runs: at most one attempt fails, then
// new events are applied.
func TestTableClaimingConsumerInV7ModeAppliesNewEventsAfterThePartitionSwitch(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"database/sql", "pgx exec mode"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, schema := testenv.Pool(t)
			table := schema + ".processed_event"
			owner, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, owner.Migrate(ctx, sqldb.Pgx(pool)))
			_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
			require.NoError(t, err)

			var beginner inbox.TxBeginner
			var q sqldb.Querier
			if kind == "database/sql" {
				std, err := sql.Open("pgx", testenv.SchemaURL(schema))
				require.NoError(t, err)
				t.Cleanup(func() { _ = std.Close() })
				beginner, err = inbox.NewStdBeginner(std)
				require.NoError(t, err)
				q = sqldb.Std(std)
			} else {
				// pgx's exec mode (as behind PgBouncer): the pipelined
				// claim is a pgx.Batch of the table's claim.
				cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 4)
				cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
				exec, err := pgxpool.NewWithConfig(ctx, cfg)
				require.NoError(t, err)
				t.Cleanup(exec.Close)
				beginner, err = inbox.NewPgxBeginner(exec, inbox.PgxBeginnerConfig{})
				require.NoError(t, err)
				q = sqldb.Pgx(exec)
			}
			attempt, _ := v7ModeAttempt(t, q, table, beginner)

			before := uuid.Must(uuid.NewV7())
			require.NoError(t, attempt(before))
			var inV7 int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_v7 WHERE event_id = $1`, before).Scan(&inV7))
			require.Equal(t, 1, inV7, "mirrored by the trigger")

			part, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour, Layout: processedstore.LayoutPartitioned})
			require.NoError(t, err)
			require.NoError(t, part.MigrateToPartitioned(ctx, sqldb.Pgx(pool)))

			var failed []error
			for i := 0; i < 4; i++ {
				if err := attempt(uuid.Must(uuid.NewV7())); err != nil {
					failed = append(failed, err)
				}
			}
			for i, err := range failed {
				t.Logf("failed attempt %d: %v", i+1, err)
			}
			require.LessOrEqual(t, len(failed), 1, "new events keep failing after the switch")
		})
	}
}
