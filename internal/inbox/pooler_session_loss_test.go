package inbox_test

import (
	"context"
	"fmt"
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

// Behind PgBouncer (session and transaction pooling, every exec mode), the
// server session of an attempt is terminated after BEGIN+claim (from a
// second session, by pg_terminate_backend, while the handler runs). The
// attempt must fail as transient (held, never poisoned), leave no claim,
// and the next attempt must apply the event once.
func TestPoolerServerSessionLostDuringHandlerIsHeldAndAppliedOnce(t *testing.T) {
	for _, after := range []bool{false, true} {
		t.Run(fmt.Sprintf("afterEffect=%v", after), func(t *testing.T) { poolerSessionLost(t, after) })
	}
}

// poolerSessionLost: with afterEffect the session is terminated after the
// handler's last statement, so the consumer's COMMIT meets it.
func poolerSessionLost(t *testing.T, afterEffect bool) {
	admin, schema := testenv.Pool(t)
	for _, mode := range []string{"session", "transaction"} {
		bouncer := testenv.StartPgBouncer(t, mode, "default_pool_size = 2")
		for _, em := range poolerExecModes {
			t.Run(fmt.Sprintf("%s/%v", mode, em), func(t *testing.T) {
				ctx := context.Background()
				name := fmt.Sprintf("%s_%d", mode, int(em))
				store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_" + name, Horizon: time.Hour})
				require.NoError(t, err)
				require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
				_, err = admin.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s.effect_%s (event_id uuid NOT NULL)`, schema, name))
				require.NoError(t, err)
				pool := bouncer.PoolBehind(t, em, 2)
				beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
				require.NoError(t, err)
				m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "c_" + name}, watermill.NopLogger{})
				require.NoError(t, err)
				kill := true
				h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := inbox.PgxTxFromContext(msg.Context())
					var pid int
					if err := tx.QueryRow(msg.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
						return nil, err
					}
					if kill && !afterEffect {
						kill = false
						var ok bool
						require.NoError(t, admin.QueryRow(ctx, `SELECT pg_terminate_backend($1::int)`, pid).Scan(&ok))
						require.True(t, ok)
					}
					_, err := tx.Exec(msg.Context(), fmt.Sprintf(`INSERT INTO %s.effect_%s (event_id) VALUES ($1::uuid)`, schema, name), pgx.QueryExecModeSimpleProtocol, msg.UUID)
					if err == nil && kill && afterEffect {
						kill = false
						var ok bool
						require.NoError(t, admin.QueryRow(ctx, `SELECT pg_terminate_backend($1::int)`, pid).Scan(&ok))
						require.True(t, ok)
						// Wait until the backend is gone, so COMMIT meets a dead session.
						for {
							var alive bool
							require.NoError(t, admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive))
							if !alive {
								break
							}
							time.Sleep(5 * time.Millisecond)
						}
					}
					return nil, err
				})
				msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
				var errs []error
				for i := 0; i < 20; i++ {
					_, err := h(msg)
					if err == nil {
						break
					}
					errs = append(errs, err)
					require.Truef(t, inbox.IsTransient(err), "attempt %d: a lost server session is not transient (class %s): %v", i+1, inbox.ClassOf(err), err)
				}
				require.NotEmpty(t, errs, "the lost session did not fail the attempt")
				var n int
				require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s.effect_%s`, schema, name)).Scan(&n))
				require.Equal(t, 1, n)
				require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s.processed_%s`, schema, name)).Scan(&n))
				require.Equal(t, 1, n)
			})
		}
	}
}
