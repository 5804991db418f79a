package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The middleware's contract through database/sql on every dialect: claim,
// duplicate, rollback on error and on panic, fresh transaction per Retry
// attempt, concurrent deliveries → one effect.
func TestStdDialectContract(t *testing.T) {
	t.Parallel()
	targets := map[string]func(t *testing.T) (*sql.DB, sqldb.Dialect, string){
		"postgres-stdlib": func(t *testing.T) (*sql.DB, sqldb.Dialect, string) {
			db, err := sql.Open("pgx", testenv.SchemaURL(testenv.Schema(t)))
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			return db, sqldb.PostgreSQL, `INSERT INTO effect (event_id, note) VALUES ($1, $2)`
		},
		"mariadb": func(t *testing.T) (*sql.DB, sqldb.Dialect, string) {
			return testenv.MySQLDB(t), sqldb.MySQL, `INSERT INTO effect (event_id, note) VALUES (?, ?)`
		},
		"sqlite": func(t *testing.T) (*sql.DB, sqldb.Dialect, string) {
			return testenv.SQLiteDB(t), sqldb.SQLite, `INSERT INTO effect (event_id, note) VALUES (?, ?)`
		},
	}
	for name, open := range targets {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, dialect, insert := open(t)
			store, err := processedstore.NewStore(processedstore.Config{Dialect: dialect})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Std(db)))
			_, err = db.Exec(`CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
			require.NoError(t, err)
			effects := func(id string) int {
				var n int
				q := `SELECT count(*) FROM effect WHERE event_id = ?`
				if dialect == sqldb.PostgreSQL {
					q = `SELECT count(*) FROM effect WHERE event_id = $1`
				}
				require.NoError(t, db.QueryRow(q, id).Scan(&n))
				return n
			}
			m, err := inbox.NewIdempotent(inbox.Config{
				Beginner: mustBeginner(inbox.NewStdBeginner(db)),
				Store:    store,
				Consumer: "stock",
			}, nil)
			require.NoError(t, err)
			var mode atomic.Value
			var calls atomic.Int32
			handler := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				tx, ok := inbox.SQLTxFromContext(msg.Context())
				require.True(t, ok)
				if _, err := tx.ExecContext(msg.Context(), insert, msg.UUID, "x"); err != nil {
					return nil, err
				}
				switch mode.Load() {
				case "error":
					return nil, errors.New("fails after writing")
				case "panic":
					panic("fails after writing")
				case "slow":
					time.Sleep(200 * time.Millisecond)
				}
				return nil, nil
			})
			deliver := func(id string) error { _, err := wmw.Recoverer(handler)(newMsg(id)); return err }

			id := uuid.Must(uuid.NewV7()).String()
			mode.Store("error")
			require.Error(t, deliver(id))
			mode.Store("panic")
			require.Error(t, deliver(id))
			require.Equal(t, 0, effects(id), "failed attempts leave nothing")
			mode.Store("ok")
			require.NoError(t, deliver(id))
			require.NoError(t, deliver(id))
			require.EqualValues(t, 3, calls.Load())
			require.Equal(t, 1, effects(id))

			// Retry in-process: a fresh transaction per attempt.
			retryID := uuid.Must(uuid.NewV7()).String()
			var attempts atomic.Int32
			retried := (wmw.Retry{MaxRetries: 2, InitialInterval: time.Millisecond, ResetContextOnRetry: true}).Middleware(
				m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := inbox.SQLTxFromContext(msg.Context())
					if _, err := tx.ExecContext(msg.Context(), insert, msg.UUID, "r"); err != nil {
						return nil, err
					}
					if attempts.Add(1) == 1 {
						return nil, errors.New("first attempt fails")
					}
					return nil, nil
				}))
			_, err = retried(newMsg(retryID))
			require.NoError(t, err)
			require.EqualValues(t, 2, attempts.Load())
			require.Equal(t, 1, effects(retryID))

			// Concurrent deliveries of one event: one effect.
			concID := uuid.Must(uuid.NewV7()).String()
			mode.Store("slow")
			var wg sync.WaitGroup
			for i := 0; i < 4; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						err := deliver(concID)
						if err == nil {
							return
						}
						if !inbox.IsTransient(err) { // lock wait / busy: retried like the chain would
							t.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			require.Equal(t, 1, effects(concID))
			require.Equal(t, 0, db.Stats().InUse)
		})
	}
}

// The pgx beginner only speaks PostgreSQL: a store of another dialect is a
// configuration error at construction.
func TestPgxBeginnerNeedsPostgresStore(t *testing.T) {
	t.Parallel()
	store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	pool, err := pgxpool.New(context.Background(), testenv.PostgresURL()) // connects lazily
	require.NoError(t, err)
	defer pool.Close()
	_, err = inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Store:    store,
		Consumer: "c",
	}, nil)
	require.ErrorContains(t, err, "Config.Beginner")
}
