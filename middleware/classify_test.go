package middleware_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/go-sql-driver/mysql"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// chained wraps h in the recommended chain (NewHandlerMiddleware) with fast
// retries and a short hold, so that a held delivery comes back (nack) within
// the test.
func chained(t *testing.T, idem *middleware.Idempotent, poison message.Publisher, logger watermill.LoggerAdapter, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	return chainedHold(t, idem, poison, logger, 300*time.Millisecond, h)
}

// chainedHold is chained with its own MaxHold: the tests that expect the
// hold to succeed give it room on a loaded machine.
func chainedHold(t *testing.T, idem *middleware.Idempotent, poison message.Publisher, logger watermill.LoggerAdapter, hold time.Duration, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	mw, err := middleware.NewHandlerMiddleware(middleware.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
		MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond,
		MaxHold: hold,
	}, logger)
	require.NoError(t, err)
	return mw(h)
}

func gunzipError() error {
	_, err := gzip.NewReader(bytes.NewReader([]byte{0x1f, 0x8b, 8, 0, 0}))
	return err
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

var _ net.Error = timeoutErr{}

// liteBusy has the shape of modernc.org/sqlite's error with SQLITE_BUSY: a
// handler that gets it from a connection of its own (not the attempt's) is
// not in a transient state of the attempt.
type liteBusy struct{}

func (liteBusy) Error() string { return "database is locked (5) (SQLITE_BUSY)" }
func (liteBusy) Code() int     { return 5 }

// B.8: a handler's own io.EOF, net.Error, DeadlineExceeded or gzip error is
// ordinary: retried MaxRetries times, then poisoned once (today: transient
// by shape, nacked and redelivered forever).
func TestHandlerOwnShapeErrorsAreOrdinary(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := middleware.NewIdempotent(middleware.Config{
		Beginner: mustBeginner(middleware.NewPgxBeginner(e.pool, middleware.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	for name, herr := range map[string]error{
		"gunzip":            gunzipError(),
		"io.EOF":            fmt.Errorf("read payload: %w", io.EOF),
		"unexpected EOF":    io.ErrUnexpectedEOF,
		"net.Error":         &net.OpError{Op: "dial", Net: "tcp", Err: timeoutErr{}},
		"deadline exceeded": fmt.Errorf("call provider: %w", context.DeadlineExceeded),
		"ECONNREFUSED":      &os.SyscallError{Syscall: "connect", Err: errors.New("refused")},
		"SQLITE_BUSY shape": fmt.Errorf("other connection: %w", liteBusy{}),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			require.Error(t, herr)
			require.False(t, middleware.IsTransient(herr), "shape alone is not transient")
			poison := &capture{msgs: make(chan *message.Message, 2)}
			var calls atomic.Int32
			h := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				return nil, herr
			})
			id := uuid.Must(uuid.NewV7()).String()
			_, err := h(newMsg(id))
			require.NoError(t, err, "poisoned, then acked")
			require.EqualValues(t, 3, calls.Load(), "1 + MaxRetries attempts, then poisoned")
			require.Len(t, poison.msgs, 1)
			require.Equal(t, "exhausted", (<-poison.msgs).Metadata.Get(middleware.MetadataPoisonClass))
			require.Zero(t, e.processed(id))
		})
	}
	require.True(t, middleware.IsTransient(middleware.Transient(io.EOF)), "unless the handler says so")
}

// B.8: the attempt's own connection breaks while the handler runs: the
// handler's error (whatever its shape) comes with a failed rollback, so it
// is infrastructure by origin: held, retried in place, applied once, never
// poisoned.
func TestConnectionLostInHandlerIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	idem, err := middleware.NewIdempotent(middleware.Config{
		Beginner: mustBeginner(middleware.NewPgxBeginner(pool, middleware.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	var seen []error
	h := chainedHold(t, idem, poison, nil, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 1 {
			proxy.Cut() // the attempt's connection dies under the handler
		}
		err := writeEffect(msg, "x")
		if err != nil {
			seen = append(seen, err)
		}
		return nil, err
	})
	// Seen from inside: what the handler returns on the cut connection.
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.GreaterOrEqual(t, calls.Load(), int32(2))
	require.NotEmpty(t, seen)
	require.False(t, middleware.IsTransient(seen[0]), "the handler's error alone is not classified transient by shape")
	require.Empty(t, poison.msgs, "held, not poisoned")
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 1, e.processed(E1))
}

// B.8: the connection breaks between the handler's success and COMMIT: the
// failed commit is the middleware's own call, so it is infrastructure by
// origin (held, retried in place); the effect is applied once.
func TestConnectionLostAtCommitIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	logger := watermill.NewCaptureLogger()
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	h := chainedHold(t, e.idempotent(pool), poison, logger, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if err := writeEffect(msg, "x"); err != nil {
			return nil, err
		}
		if calls.Add(1) == 1 {
			proxy.Cut() // COMMIT will find the connection gone
		}
		return nil, nil
	})
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.GreaterOrEqual(t, calls.Load(), int32(2))
	require.Empty(t, poison.msgs)
	require.Equal(t, 1, e.effects(E1))
	held := 0
	for _, m := range logger.Captured()[watermill.InfoLogLevel] {
		if m.Msg == "Infrastructure failure: delivery held, not poisoned" {
			held++
			require.ErrorIs(t, m.Fields["error"].(error), middleware.ErrInfrastructure)
		}
	}
	require.GreaterOrEqual(t, held, 1, "the failed COMMIT was held (later holds: idle connections the cut killed)")
}

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
			idem, err := middleware.NewIdempotent(middleware.Config{
				Beginner: mustBeginner(middleware.NewPgxBeginner(pool, middleware.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
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
			require.True(t, middleware.IsTransient(err), "%v", err)
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
		store, err := processed.NewStore(processed.Config{Dialect: sqldb.MySQL})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, sqldb.Std(rw)))
		_, err = rw.Exec(`CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
		require.NoError(t, err)
		var calls atomic.Int32
		poison := &capture{msgs: make(chan *message.Message, 3)}
		deliver := func(db *sql.DB, id string) error {
			idem, err := middleware.NewIdempotent(middleware.Config{
				Beginner: mustBeginner(middleware.NewStdBeginner(db)), Store: store, Consumer: "stock", Classifier: mysqlerr.Classify,
			}, nil)
			require.NoError(t, err)
			_, err = chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				tx, _ := middleware.SQLTxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'x')`, msg.UUID)
				return nil, err
			})(newMsg(id))
			return err
		}
		ids := []string{uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()}
		for _, id := range ids {
			err := deliver(ro, id)
			require.Error(t, err)
			require.True(t, middleware.IsTransient(err), "%v", err)
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
		require.True(t, middleware.IsTransient(err), code)
		require.False(t, middleware.ShouldPoison(err), code)
	}
	for _, n := range []uint16{1290, 1792, 1205, 1213, 2013} {
		require.Equal(t, middleware.ClassTransient, mysqlerr.Classify(&mysql.MySQLError{Number: n}), n)
	}
	require.Equal(t, middleware.ClassOrdinary, mysqlerr.Classify(&mysql.MySQLError{Number: 1062}))
	require.Equal(t, middleware.ClassOrdinary, mysqlerr.Classify(io.EOF))
}

// B.7: configuration errors never empty the queue into the poison topic: a
// processed table that was never migrated (PostgreSQL 42P01, MariaDB 1146,
// SQLite "no such table"), a handler's own missing table or privilege. The
// delivery is held and given back (nack), an ERROR log says what to fix.
func TestConfigurationErrorsAreHeldNotPoisoned(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"42P01", "42703", "42501"} {
		require.True(t, middleware.IsConfiguration(&pgconn.PgError{Code: code}), code)
		require.False(t, middleware.ShouldPoison(&pgconn.PgError{Code: code}), code)
	}
	for _, n := range []uint16{1146, 1054, 1142} {
		require.Equal(t, middleware.ClassConfiguration, mysqlerr.Classify(&mysql.MySQLError{Number: n}), n)
	}
	check := func(t *testing.T, beginner middleware.TxBeginner, store *processed.Store, cls middleware.ErrorClassifier, h message.HandlerFunc) {
		t.Helper()
		logger := watermill.NewCaptureLogger()
		idem, err := middleware.NewIdempotent(middleware.Config{Beginner: beginner, Store: store, Consumer: "stock", Classifier: cls}, logger)
		require.NoError(t, err)
		poison := &capture{msgs: make(chan *message.Message, 1)}
		_, err = chained(t, idem, poison, logger, h)(newMsg(uuid.Must(uuid.NewV7()).String()))
		require.Error(t, err, "held, then given back: never acked")
		require.ErrorIs(t, err, middleware.ErrConfiguration)
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
	unmigrated, err := processed.NewStore(processed.Config{Table: "never_migrated"})
	require.NoError(t, err)

	t.Run("postgres processed table missing", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		check(t, mustBeginner(middleware.NewPgxBeginner(e.pool, middleware.PgxBeginnerConfig{})), unmigrated, nil, noop)
	})
	t.Run("postgres handler table missing", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		check(t, mustBeginner(middleware.NewPgxBeginner(e.pool, middleware.PgxBeginnerConfig{})), e.store, nil, func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO no_such_table VALUES (1)`)
			return nil, err
		})
	})
	t.Run("mariadb processed table missing", func(t *testing.T) {
		t.Parallel()
		store, err := processed.NewStore(processed.Config{Table: "never_migrated", Dialect: sqldb.MySQL})
		require.NoError(t, err)
		check(t, mustBeginner(middleware.NewStdBeginner(testenv.MySQLDB(t))), store, mysqlerr.Classify, noop)
	})
	t.Run("sqlite processed table missing", func(t *testing.T) {
		t.Parallel()
		store, err := processed.NewStore(processed.Config{Table: "never_migrated", Dialect: sqldb.SQLite})
		require.NoError(t, err)
		check(t, mustBeginner(middleware.NewStdBeginner(testenv.SQLiteDB(t))), store, nil, noop)
	})
}

// The chain's outer layer sees the attempt's errors after Retry gave up on
// ordinary ones only: a transient error is not retried by Retry (it is held
// in place instead), so attempts = holds, not holds × MaxRetries.
func TestTransientErrorsSkipRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := middleware.NewIdempotent(middleware.Config{
		Beginner: mustBeginner(middleware.NewPgxBeginner(e.pool, middleware.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	poison := &capture{msgs: make(chan *message.Message, 1)}
	h := chainedHold(t, idem, poison, nil, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) <= 3 {
			return nil, middleware.Transient(errors.New("provider says later"))
		}
		return nil, writeEffect(msg, "x")
	})
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.EqualValues(t, 4, calls.Load())
	require.Equal(t, 1, e.effects(E1))
	require.Empty(t, poison.msgs)
	_ = wmw.ReasonForPoisonedKey
}

// B.9: a delivery held without a bound (MaxHold < 0) is given back as soon
// as its message context ends (router shutdown), with the transient error:
// never acked, never poisoned.
func TestHoldEndsAtShutdown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	mw, err := middleware.NewHandlerMiddleware(middleware.ChainConfig{
		Idempotent: e.idempotent(e.pool), PoisonPublisher: poison, PoisonTopic: "poison",
		InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond, MaxHold: -1,
	}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 5 {
			cancel() // the router closes while the delivery is held
		}
		return nil, &pgconn.PgError{Code: "57P03"}
	})
	m := newMsg(E1)
	m.SetContext(ctx)
	_, err = h(m)
	require.Error(t, err)
	require.True(t, middleware.IsTransient(err))
	require.EqualValues(t, 5, calls.Load())
	require.Empty(t, poison.msgs)
}
