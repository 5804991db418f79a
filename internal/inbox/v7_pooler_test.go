package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Behind PgBouncer in transaction pooling, with other clients moving the
// server connections, a consumer whose UUIDv7 claims go to
// processed_event_v7 applies each event once, in pgx's exec and simple protocol modes (the cache modes need PgBouncer 1.21+).
func TestV7TableClaimBehindATransactionPoolerAppliesEachEventOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := context.Background()
			bouncer := testenv.StartPgBouncer(t, "transaction", "default_pool_size = 2")
			bouncer.OtherClients(t, 2)
			admin, schema := testenv.Pool(t)
			store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			_, err = admin.Exec(ctx, `CREATE TABLE `+schema+`.effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL)`)
			require.NoError(t, err)
			pool := bouncer.PoolBehind(t, mode, 2)
			require.NoError(t, store.CheckLean(ctx, sqldb.PgxHandle(pool).Querier(), "stock")) // as NewConsumer
			p, ok := store.ClaimParamsAt("stock", uuid.Must(uuid.NewV7()), time.Time{}, nil)
			require.True(t, ok)
			require.NotZero(t, p.ConsumerID, "claims in the v7 table")

			beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := inbox.PgxTxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), `INSERT INTO `+schema+`.effect (event_id) VALUES ($1)`, msg.UUID)
				return nil, err
			})
			var ids []uuid.UUID
			for i := 0; i < 20; i++ {
				ids = append(ids, uuid.Must(uuid.NewV7()))
			}
			for round := 0; round < 3; round++ {
				for _, id := range ids {
					_, err := h(preparedClaimMsg(t, id, `{"n":1}`))
					require.NoError(t, err, "round %d event %s", round, id)
				}
			}
			var effects, inV7 int
			require.NoError(t, admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+schema+`.effect), (SELECT count(*) FROM `+schema+`.processed_event_v7)`).Scan(&effects, &inV7))
			require.Equal(t, len(ids), effects, "each event applied once")
			require.Equal(t, len(ids), inV7, "claimed in the v7 table")
		})
	}
}
