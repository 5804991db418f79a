package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// TestReadOnlyDatabaseIsTransientAndAppliedOnceAfterFailover (N01) — a database that refuses writes (failover, standby): the claim
// fails with 25006 (PostgreSQL) or 1792 (MariaDB): transient, no handler
// call, nothing poisoned, nothing acked (the held delivery is given back);
// after the failover (a new pool) each message is applied once.
func TestReadOnlyDatabaseIsTransientAndAppliedOnceAfterFailover(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
		cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
		ro, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		defer ro.Close()
		var calls atomic.Int32
		handler := func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, writeEffect(msg, "x")
		}
		poison := &capture{msgs: make(chan *message.Message, 3)}
		deliverAll := func(pool *pgxpool.Pool, ids []string) []error {
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
			}, nil)
			require.NoError(t, err)
			h := chained(t, idem, poison, nil, handler)
			var errs []error
			for _, id := range ids {
				_, err := h(newMsg(id))
				errs = append(errs, err)
			}
			return errs
		}
		ids := []string{uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()}
		for _, err := range deliverAll(ro, ids) {
			require.Error(t, err, "not acked")
			require.True(t, inbox.IsTransient(err), "%v", err)
			var pg *pgconn.PgError
			require.ErrorAs(t, err, &pg)
			require.Equal(t, "25006", pg.Code)
		}
		require.Zero(t, calls.Load(), "no handler call while read-only")
		require.Empty(t, poison.msgs)
		for _, err := range deliverAll(e.pool, ids) { // the failover completed
			require.NoError(t, err)
		}
		for _, id := range ids {
			require.Equal(t, 1, e.effects(id))
		}
		require.EqualValues(t, 3, calls.Load())
		require.Empty(t, poison.msgs, "DLQ 0")
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		name := testenv.MySQLDatabase(t)
		open := func(dsn string) *sql.DB {
			db, err := sql.Open("mysql", dsn)
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			return db
		}
		rw := open(testenv.MySQLDatabaseDSN(name))
		ro := open(testenv.MySQLDatabaseDSN(name) + "&tx_read_only=1") // SET SESSION tx_read_only=1 on every connection
		store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, sqldb.Std(rw)))
		_, err = rw.Exec(`CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
		require.NoError(t, err)
		var calls atomic.Int32
		poison := &capture{msgs: make(chan *message.Message, 3)}
		deliver := func(db *sql.DB, id string) error {
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: mustBeginner(inbox.NewStdBeginner(db)), Store: store, Consumer: "stock", Classifier: mysqlerr.Classify,
			}, nil)
			require.NoError(t, err)
			_, err = chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				tx, _ := inbox.SQLTxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'x')`, msg.UUID)
				return nil, err
			})(newMsg(id))
			return err
		}
		ids := []string{uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()}
		for _, id := range ids {
			err := deliver(ro, id)
			require.Error(t, err)
			require.True(t, inbox.IsTransient(err), "%v", err)
			var me *mysql.MySQLError
			require.ErrorAs(t, err, &me)
			require.EqualValues(t, 1792, me.Number)
		}
		require.Zero(t, calls.Load())
		require.Empty(t, poison.msgs)
		for _, id := range ids {
			require.NoError(t, deliver(rw, id))
		}
		var n int
		require.NoError(t, rw.QueryRow(`SELECT count(*) FROM effect`).Scan(&n))
		require.Equal(t, 3, n)
		require.EqualValues(t, 3, calls.Load())
		require.Empty(t, poison.msgs)
	})
}

// B.6: the codes of a database that refuses writes are transient, wherever
// they arise (they are typed server answers).
func TestRefusedWritesAreTransient(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"25006", "53100", "53200", "53300", "58030", "08006", "57P01", "40001", "40P01", "55P03"} {
		err := fmt.Errorf("handler: %w", &pgconn.PgError{Code: code})
		require.True(t, inbox.IsTransient(err), code)
		require.False(t, inbox.ShouldPoison(err), code)
	}
	for _, n := range []uint16{1290, 1792, 1205, 1213, 2013} {
		require.Equal(t, inbox.ClassTransient, mysqlerr.Classify(&mysql.MySQLError{Number: n}), n)
	}
	require.Equal(t, inbox.ClassOrdinary, mysqlerr.Classify(&mysql.MySQLError{Number: 1062}))
	require.Equal(t, inbox.ClassOrdinary, mysqlerr.Classify(io.EOF))
}

// B.7: configuration errors never empty the queue into the poison topic: a
// processed table that was never migrated (PostgreSQL 42P01, MariaDB 1146,
// SQLite "no such table"), a handler's own missing table or privilege. The
// delivery is held and given back (nack), an ERROR log says what to fix.
func TestConfigurationErrorsAreHeldNotPoisoned(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"42P01", "42703", "42501"} {
		require.True(t, inbox.IsConfiguration(&pgconn.PgError{Code: code}), code)
		require.False(t, inbox.ShouldPoison(&pgconn.PgError{Code: code}), code)
	}
	for _, n := range []uint16{1146, 1054, 1142} {
		require.Equal(t, inbox.ClassConfiguration, mysqlerr.Classify(&mysql.MySQLError{Number: n}), n)
	}
	check := func(t *testing.T, beginner inbox.TxBeginner, store *processedstore.Store, cls inbox.ErrorClassifier, h message.HandlerFunc) {
		t.Helper()
		logger := watermill.NewCaptureLogger()
		idem, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock", Classifier: cls}, logger)
		require.NoError(t, err)
		poison := &capture{msgs: make(chan *message.Message, 1)}
		_, err = chained(t, idem, poison, logger, h)(newMsg(uuid.Must(uuid.NewV7()).String()))
		require.Error(t, err, "held, then given back: never acked")
		require.ErrorIs(t, err, inbox.ErrConfiguration)
		require.Empty(t, poison.msgs, "never poisoned")
		var hint string
		for _, m := range logger.Captured()[watermill.ErrorLogLevel] {
			if m.Msg == "Configuration error: delivery held, not poisoned" {
				hint, _ = m.Fields["hint"].(string)
			}
		}
		require.NotEmpty(t, hint, "an ERROR log says what to fix")
	}
	noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	unmigrated, err := processedstore.NewStore(processedstore.Config{Table: "never_migrated"})
	require.NoError(t, err)

	t.Run("postgres processed table missing", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		check(t, mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), unmigrated, nil, noop)
	})
	t.Run("postgres handler table missing", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		check(t, mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), e.store, nil, func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO no_such_table VALUES (1)`)
			return nil, err
		})
	})
	t.Run("mariadb processed table missing", func(t *testing.T) {
		t.Parallel()
		store, err := processedstore.NewStore(processedstore.Config{Table: "never_migrated", Dialect: sqldb.MySQL})
		require.NoError(t, err)
		check(t, mustBeginner(inbox.NewStdBeginner(testenv.MySQLDB(t))), store, mysqlerr.Classify, noop)
	})
	t.Run("sqlite processed table missing", func(t *testing.T) {
		t.Parallel()
		store, err := processedstore.NewStore(processedstore.Config{Table: "never_migrated", Dialect: sqldb.SQLite})
		require.NoError(t, err)
		check(t, mustBeginner(inbox.NewStdBeginner(testenv.SQLiteDB(t))), store, nil, noop)
	})
}
