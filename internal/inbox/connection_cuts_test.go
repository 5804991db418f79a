package inbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// poisonRecorder records what reaches the poison topic.
type poisonRecorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *poisonRecorder) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *poisonRecorder) Close() error { return nil }

// TestConnectionsCutAtRandomPoisonNothingAndApplyEachEffectOnce: guarantees.md
// "Database outages don't poison" and "Once per (consumer, event_id)":
// connections are cut at random moments (mid-claim, mid-handler,
// mid-commit: ambiguous commits) while messages run through the whole
// chain. Each delivery must end acked (nil) with its effect once, none
// poisoned. Direct, and behind PgBouncer 1.24 in transaction pooling
// (the client side cut, so PgBouncer drops server connections mid
// transaction). A cut every 10–40 ms, at most one per delivery ended.

func TestConnectionsCutAtRandomPoisonNothingAndApplyEachEffectOnce(t *testing.T) {
	for _, via := range []string{"direct", "pgbouncer"} {
		t.Run(via, func(t *testing.T) {
			admin, schema := testenv.Pool(t)
			ctx := context.Background()
			store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event"})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			require.NoError(t, store.CheckLean(ctx, sqldb.Pgx(admin), "stock"))
			_, err = admin.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s.effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL)`, schema))
			require.NoError(t, err)

			target := "127.0.0.1:5432"
			if via == "pgbouncer" {
				b := testenv.StartNewerPgBouncer(t, "transaction", "max_prepared_statements = 200")
				target = fmt.Sprintf("127.0.0.1:%d", b.Port)
			} else {
				c := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 4)
				target = fmt.Sprintf("%s:%d", c.ConnConfig.Host, c.ConnConfig.Port)
			}
			proxy, err := faultproxy.Start(target)
			require.NoError(t, err)
			t.Cleanup(func() { _ = proxy.Close() })
			cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
			require.NoError(t, err)
			cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
			cfg.MaxConns = 4
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)

			beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			poison := &poisonRecorder{}
			mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
				Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "dlq",
				MaxRetries: 3, InitialInterval: 5 * time.Millisecond, MaxInterval: 100 * time.Millisecond, MaxHold: 2 * time.Minute,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			insert := fmt.Sprintf(`INSERT INTO %s.effect (event_id) VALUES ($1::uuid)`, schema)
			h := mw(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := inbox.PgxTxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), insert, pgx.QueryExecModeExec, msg.UUID); err != nil {
					return nil, err
				}
				time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond)
				_, err := tx.Exec(msg.Context(), `SELECT 1`, pgx.QueryExecModeExec)
				return nil, err
			})

			stop := make(chan struct{})
			var cutter sync.WaitGroup
			cutter.Add(1)
			var cuts, delivered atomic.Int32
			go func() {
				defer cutter.Done()
				last := int32(-1)
				for {
					select {
					case <-stop:
						return
					case <-time.After(time.Duration(10+rand.IntN(30)) * time.Millisecond):
						// At most one cut per delivery ended since the
						// last one: cuts that came faster than connections
						// could be made again cut every reconnection too
						// (each a cancel request and a new connection for
						// the server), and the shared server's listen
						// queue overflowed (SYNs dropped, connects backing
						// off for minutes) with nothing ever delivered.
						if d := delivered.Load(); d != last {
							last = d
							proxy.Cut()
							cuts.Add(1)
						}
					}
				}
			}()

			const n = 600
			ids := make([]string, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			sem := make(chan struct{}, 4)
			for i := range ids {
				ids[i] = uuid.Must(uuid.NewV7()).String()
				wg.Add(1)
				sem <- struct{}{}
				go func(i int) {
					defer wg.Done()
					defer func() { <-sem }()
					m := message.NewMessage(ids[i], []byte(`{}`))
					m.Metadata.Set(marshaler.MetadataEventName, "order.placed")
					_, errs[i] = h(m)
					delivered.Add(1)
				}(i)
			}
			wg.Wait()
			close(stop)
			cutter.Wait()
			t.Logf("%d cuts", cuts.Load())

			var failed []string
			for i, err := range errs {
				if err != nil {
					failed = append(failed, fmt.Sprintf("%s: %v", ids[i], err))
				}
			}
			require.Empty(t, failed, "deliveries given back within MaxHold")
			var reasons []string
			for _, m := range poison.msgs {
				reasons = append(reasons, m.UUID+": "+m.Metadata.Get("reason_poisoned"))
			}
			require.Empty(t, reasons, "a connection cut poisoned a message")
			var total, distinct int
			require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(DISTINCT event_id) FROM %s.effect`, schema)).Scan(&total, &distinct))
			require.Equal(t, total, distinct, "an effect applied twice")
			require.Equal(t, n, total, "an acked delivery lost its effect")
		})
	}
}
