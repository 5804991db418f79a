package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A handler that ends the attempt's transaction by SQL (ROLLBACK, COMMIT,
// END, ABORT sent through Exec, which the transaction types cannot see)
// and returns nil fails the attempt as its own misuse (permanent, reason
// handler_ended_tx): the delivery is never acked while its claim is gone
// (ROLLBACK, ABORT: a redelivery would apply the effect again). On every
// beginner: pgx pipelined (prepared claim, pgx.Batch claim), pgx's own
// transaction, database/sql (case 27.4).
func TestHandlerEndingTheTransactionBySQLIsNotAcked(t *testing.T) {
	t.Parallel()
	type beginner struct {
		name  string
		build func(t *testing.T, schema string) (inbox.TxBeginner, func(ctx context.Context, stmt string) error)
	}
	pgxBeginner := func(mode pgx.QueryExecMode, cfg inbox.PgxBeginnerConfig) func(t *testing.T, schema string) (inbox.TxBeginner, func(context.Context, string) error) {
		return func(t *testing.T, schema string) (inbox.TxBeginner, func(context.Context, string) error) {
			pc := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 2)
			pc.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(context.Background(), pc)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			b, err := inbox.NewPgxBeginner(pool, cfg)
			require.NoError(t, err)
			return b, func(ctx context.Context, stmt string) error {
				tx, ok := inbox.PgxTxFromContext(ctx)
				if !ok {
					return errors.New("no pgx tx")
				}
				if _, err := tx.Exec(ctx, `INSERT INTO effect (event_id) VALUES (gen_random_uuid())`); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, stmt)
				return err
			}
		}
	}
	beginners := []beginner{
		{"pgx-prepared", pgxBeginner(pgx.QueryExecModeCacheStatement, inbox.PgxBeginnerConfig{})},
		{"pgx-batch", pgxBeginner(pgx.QueryExecModeSimpleProtocol, inbox.PgxBeginnerConfig{})},
		{"pgx-native", pgxBeginner(pgx.QueryExecModeCacheStatement, inbox.PgxBeginnerConfig{DisablePipeline: true})},
		{"database-sql", func(t *testing.T, schema string) (inbox.TxBeginner, func(context.Context, string) error) {
			db, err := sql.Open("pgx", testenv.SchemaURL(schema))
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			b, err := inbox.NewStdBeginner(db)
			require.NoError(t, err)
			return b, func(ctx context.Context, stmt string) error {
				tx, ok := inbox.SQLTxFromContext(ctx)
				if !ok {
					return errors.New("no sql tx")
				}
				if _, err := tx.ExecContext(ctx, `INSERT INTO effect (event_id) VALUES (gen_random_uuid())`); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, stmt)
				return err
			}
		}},
	}
	for _, bg := range beginners {
		t.Run(bg.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin, schema := testenv.Pool(t)
			store, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			_, err = admin.Exec(ctx, `CREATE TABLE effect (event_id uuid)`)
			require.NoError(t, err)
			b, run := bg.build(t, schema)
			m, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			for _, stmt := range []string{"ROLLBACK", "COMMIT", "END", "ABORT"} {
				var stmtNow string
				h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					return nil, run(msg.Context(), stmtNow)
				})
				stmtNow = stmt
				id := uuid.Must(uuid.NewV7())
				_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
				require.Error(t, err, "%s: the delivery must not be acked", stmt)
				require.True(t, inbox.IsPermanent(err), "%s: the handler's misuse: %v", stmt, err)
				var p *inbox.PermanentError
				require.ErrorAs(t, err, &p)
				require.Equal(t, "handler_ended_tx", p.Reason, stmt)
				// The next attempt on the same connection works.
				stmtNow = "SELECT 1"
				_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
				require.NoError(t, err, "%s: the connection is usable again", stmt)
			}
		})
	}
}
