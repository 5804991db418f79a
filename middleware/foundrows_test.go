package middleware_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The MySQL claim reads its outcome from rows affected, so a consumer whose
// DSN sets clientFoundRows=true reads a duplicate as a new claim and applies
// its effect again. processed.Migrate refuses such a DSN, but the consumer
// may run on another DSN than the migration (or the schema may come from
// goose with MigrationsFS): NewConsumer refuses it too, with
// ErrMySQLFoundRows, before any delivery. Before this test it accepted it,
// and a duplicate delivered after the first commit ran the handler again.
func TestConsumerRefusesAFoundRowsMySQLDSN(t *testing.T) {
	t.Parallel()
	name := testenv.MySQLDatabase(t)
	ctx := context.Background()
	migrateDB, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(name))
	require.NoError(t, err)
	t.Cleanup(func() { _ = migrateDB.Close() })
	require.NoError(t, processed.Migrate(ctx, idempotency.SQL(migrateDB, idempotency.MySQL), processed.Config{}))
	_, err = migrateDB.Exec(`CREATE TABLE effect (event_id varchar(64) NOT NULL)`)
	require.NoError(t, err)

	db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(name)+"&clientFoundRows=true")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.SQL(db, idempotency.MySQL),
		Poison: middleware.PoisonConfig{Publisher: ps, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, nil)
	if err == nil {
		// What the refusal prevents: the duplicate applied twice.
		r, rerr := message.NewRouter(message.RouterConfig{}, nil)
		require.NoError(t, rerr)
		var calls atomic.Int32
		_, rerr = c.AddConsumerHandler(r, "reserve", "orders", ps, func(msg *message.Message) error {
			calls.Add(1)
			tx, _ := middleware.SQLTxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect (event_id) VALUES (?)`, msg.UUID)
			return err
		})
		require.NoError(t, rerr)
		runRouter(t, r)
		ev := newEvent(t)
		require.NoError(t, ps.Publish("orders", ev, ev.Copy()))
		time.Sleep(time.Second)
		var n int
		require.NoError(t, migrateDB.QueryRow(`SELECT count(*) FROM effect`).Scan(&n))
		t.Fatalf("NewConsumer accepted a clientFoundRows DSN: handler calls %d, effects %d for one event", calls.Load(), n)
	}
	require.ErrorIs(t, err, sqldb.ErrMySQLFoundRows)
	require.ErrorContains(t, err, "ConsumerConfig.DB")
}
