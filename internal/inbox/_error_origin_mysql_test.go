package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// TestMySQLServerStateCodesAreHeld (item 2): on MariaDB, a handler
// statement stopped by max_statement_time (1969 ER_STATEMENT_TIMEOUT,
// produced for real) is transient with mysqlerr.Classify: held, never
// poisoned, applied once on the healthy call. On the old code 1969 was
// ordinary and poisoned after the retries. The table checks the numbers
// added, each against MariaDB's perror / the MySQL reference.
func TestMySQLServerStateCodesAreHeld(t *testing.T) {
	t.Parallel()
	for _, n := range []uint16{
		1205, 1213, 1614, 1637, 1180, 1181, 1040, 1203, 1135, 1152, 1154, 1155, 1156, 1157, 1158, 1159,
		1160, 1161, 1184, 1927, 4031, 1053, 1077, 1079, 1080, 1317, 1969, 3024, 1290, 1792, 1836,
		1021, 1114, 1037, 1038, 1041, 1206, 3019, 2002, 2003, 2006, 2013, 2055,
	} {
		require.Equal(t, inbox.ClassTransient, mysqlerr.Classify(fmt.Errorf("x: %w", &mysql.MySQLError{Number: n})), n)
	}
	for _, n := range []uint16{1153, 3020, 2005, 1062, 1064, 1452} {
		require.Equal(t, inbox.ClassOrdinary, mysqlerr.Classify(&mysql.MySQLError{Number: n}), n)
	}

	ctx := context.Background()
	name := testenv.MySQLDatabase(t)
	db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(name))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Std(db)))
	_, err = db.Exec(`CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
	require.NoError(t, err)
	// Three rows to sleep over: a plain table, opened before the timer
	// fires (a SEQUENCE table such as seq_1_to_3 is discovered when
	// opened, and a timer firing there, under load, ends the statement
	// with 1939 ER_SQL_DISCOVER_ERROR instead).
	_, err = db.Exec(`CREATE TABLE three (n int)`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO three VALUES (1), (2), (3)`)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewStdBeginner(db)), Store: store, Consumer: "stock", Classifier: mysqlerr.Classify,
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	var seen []uint16
	h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		if calls.Add(1) <= faultCalls {
			_, err := tx.ExecContext(msg.Context(), `SET STATEMENT max_statement_time=0.1 FOR SELECT SLEEP(5) FROM three`)
			var me *mysql.MySQLError
			if errors.As(err, &me) {
				seen = append(seen, me.Number)
			}
			if err == nil {
				err = errors.New("max_statement_time did not stop the statement")
			}
			return nil, err
		}
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?, 'x')`, msg.UUID)
		return nil, err
	})
	id := uuid.Must(uuid.NewV7()).String()
	_, err = h(newMsg(id))
	require.NoError(t, err)
	require.Equal(t, []uint16{1969, 1969, 1969, 1969}, seen, "the server stopped the statement (ER_STATEMENT_TIMEOUT)")
	require.Empty(t, poison.msgs)
	require.EqualValues(t, faultCalls+1, calls.Load())
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM effect WHERE event_id = ?`, id).Scan(&n))
	require.Equal(t, 1, n)
}

func proxiedBeginners(t *testing.T, e *env) []proxiedBeginner {
	t.Helper()
	pgProxy := func() (*faultproxy.Proxy, *pgxpool.Config) {
		cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 4)
		proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
		cfg.ConnConfig.RuntimeParams["application_name"] = e.schema
		return proxy, cfg
	}
	var out []proxiedBeginner
	for _, disable := range []bool{false, true} {
		proxy, cfg := pgProxy()
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		name := "pgx-pipelined"
		if disable {
			name = "pgx-unpipelined"
		}
		out = append(out, proxiedBeginner{name: name, proxy: proxy, store: e.store,
			beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{DisablePipeline: disable})),
			sleepQ:   `SELECT pg_sleep(5)`, effects: e.effects, insert: `INSERT INTO effect (event_id, note) VALUES ($1, $2)`})
	}
	proxy, cfg := pgProxy()
	db := stdlib.OpenDB(*cfg.ConnConfig)
	t.Cleanup(func() { _ = db.Close() })
	out = append(out, proxiedBeginner{name: "database-sql-pgx", proxy: proxy, store: e.store,
		beginner: mustBeginner(inbox.NewStdBeginner(db)),
		sleepQ:   `SELECT pg_sleep(5)`, effects: e.effects, insert: `INSERT INTO effect (event_id, note) VALUES ($1, $2)`})

	// MariaDB through a proxy.
	name := testenv.MySQLDatabase(t)
	mcfg, err := mysql.ParseDSN(testenv.MySQLDatabaseDSN(name))
	require.NoError(t, err)
	direct, err := sql.Open("mysql", mcfg.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = direct.Close() })
	mstore, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	require.NoError(t, mstore.Migrate(context.Background(), sqldb.Std(direct)))
	_, err = direct.Exec(`CREATE TABLE effect (event_id varchar(36) NOT NULL, note varchar(100))`)
	require.NoError(t, err)
	mproxy, err := faultproxy.Start(mcfg.Addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = mproxy.Close() })
	mcfg.Addr = mproxy.Addr()
	mdb, err := sql.Open("mysql", mcfg.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = mdb.Close() })
	out = append(out, proxiedBeginner{name: "database-sql-mariadb", proxy: mproxy, store: mstore,
		beginner: mustBeginner(inbox.NewStdBeginner(mdb)), sleepQ: `SELECT SLEEP(2)`,
		effects: func(id string) int {
			var n int
			require.NoError(t, direct.QueryRow(`SELECT count(*) FROM effect WHERE event_id = ?`, id).Scan(&n))
			return n
		}, insert: `INSERT INTO effect (event_id, note) VALUES (?, ?)`})
	return out
}

// TestAttemptConnectionFailuresAreInfrastructureByOrigin (item 2): a
// client-side failure of the attempt's own connection, whatever its Go type
// (io.EOF, net.Error, context.DeadlineExceeded, driver.ErrBadConn,
// mysql.ErrInvalidConn), is infrastructure because the attempt's rollback
// then fails: the delivery is held, never poisoned, applied once when the
// connection is back. For every beginner (pgx pipelined and not,
// database/sql over pgx and over go-sql-driver/mysql): the proxy cuts the
// attempt's connection under the handler; the handler's statement on the
// attempt's transaction runs past its own deadline (the driver abandons the
// connection). The same error types from a healthy connection's handler
// stay ordinary: the control case returns io.EOF of its own and is
// poisoned once after the retries.
func TestAttemptConnectionFailuresAreInfrastructureByOrigin(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, b := range proxiedBeginners(t, e) {
		t.Run(b.name, func(t *testing.T) {
			classifier := inbox.ErrorClassifier(nil)
			if b.store.Dialect() == sqldb.MySQL {
				classifier = mysqlerr.Classify
			}
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b.beginner, Store: b.store, Consumer: "stock", Classifier: classifier}, nil)
			require.NoError(t, err)
			faults := map[string]func(msg *message.Message, q sqldb.Querier) error{
				"cut-under-handler": func(msg *message.Message, q sqldb.Querier) error {
					b.proxy.Cut()
					_, err := q.Exec(msg.Context(), b.insert, msg.UUID, "cut")
					return err
				},
				"own-deadline-on-attempt-connection": func(msg *message.Message, q sqldb.Querier) error {
					ctx, cancel := context.WithTimeout(msg.Context(), 30*time.Millisecond)
					defer cancel()
					_, err := q.Exec(ctx, b.sleepQ)
					return err
				},
			}
			for _, fault := range []string{"cut-under-handler", "own-deadline-on-attempt-connection"} {
				poison := &capture{msgs: make(chan *message.Message, 1)}
				var calls atomic.Int32
				var seen []error
				h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
					q, _ := inbox.QuerierFromContext(msg.Context())
					if calls.Add(1) <= faultCalls {
						err := faults[fault](msg, q)
						seen = append(seen, err)
						return nil, err
					}
					_, err := q.Exec(msg.Context(), b.insert, msg.UUID, "x")
					return nil, err
				})
				id := uuid.Must(uuid.NewV7()).String()
				_, err = h(newMsg(id))
				require.NoError(t, err, fault)
				require.Len(t, seen, faultCalls, fault)
				for _, err := range seen {
					require.Error(t, err, fault)
					require.False(t, inbox.IsTransient(err), "%s: the handler's error alone is not transient by shape: %v", fault, err)
				}
				require.Empty(t, poison.msgs, "%s: held, never poisoned", fault)
				require.EqualValues(t, faultCalls+1, calls.Load(), fault)
				require.Equal(t, 1, b.effects(id), fault)
			}

			// Control: the handler's own io.EOF on a healthy connection.
			poison := &capture{msgs: make(chan *message.Message, 1)}
			var calls atomic.Int32
			h := chainedHold(t, idem, poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				q, _ := inbox.QuerierFromContext(msg.Context())
				if _, err := q.Exec(msg.Context(), b.insert, msg.UUID, "x"); err != nil {
					return nil, err
				}
				return nil, fmt.Errorf("read the payload's attachment: %w", io.EOF)
			})
			id := uuid.Must(uuid.NewV7()).String()
			_, err = h(newMsg(id))
			require.NoError(t, err, "poisoned = acked")
			require.EqualValues(t, 3, calls.Load(), "1 + MaxRetries")
			require.Len(t, poison.msgs, 1)
			require.Zero(t, b.effects(id), "rolled back each time")
		})
	}
}

// TestCommitOutcomeUnknownNeverAckedNorPoisoned (item 2, commit path):
// the attempt's connection is cut while the server executes its COMMIT (a
// deferred trigger keeps COMMIT busy; the cut comes when the session is
// seen waiting inside it), so the client cannot know the outcome. On the
// cut, pgconn closes the connection with a CancelRequest (pgx v5
// pgconn.asyncClose), sent on a new connection through the proxy.
// Two branches: "committed" (the trigger waits for an advisory lock the
// test holds; the test hangs the proxy, cuts, releases the lock and
// resumes only once the claim is visible in the database, so the held
// cancel reaches the server after the COMMIT is done) and "aborted" (the
// trigger sleeps until the cancel interrupts it: the server aborts).
// Before, the committed branch let the cancel through and had the trigger
// swallow it: PostgreSQL (postmaster's signal_child) delivers one cancel
// request as two SIGINTs, to the backend and to its process group, and
// under load the second one came after the first was handled, outside the
// trigger's exception block, and aborted the COMMIT (the handler then ran
// twice). The failed COMMIT is infrastructure by origin: never acked on
// that attempt, never poisoned; the held re-run claims again and either
// finds the committed claim (duplicate, acked: handler once) or applies it
// (handler twice); effect and claim once either way. For both pgx
// beginners and database/sql over pgx.
func TestCommitOutcomeUnknownNeverAckedNorPoisoned(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// An advisory key of this test's own (the key space is the database's,
	// shared with every other test and test run).
	key := int64(crc32.ChecksumIEEE([]byte(e.schema)))
	_, err := e.pool.Exec(context.Background(), fmt.Sprintf(`
CREATE FUNCTION h11_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.note = 'sleep' THEN PERFORM pg_sleep(60); END IF; -- until the client's cancel
  IF NEW.note = 'lock' THEN PERFORM pg_advisory_xact_lock(%d); END IF; -- until the test releases it
  RETURN NULL;
END $$;`, key)+`
CREATE CONSTRAINT TRIGGER h11_slow_commit AFTER INSERT ON effect DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION h11_slow_commit()`)
	require.NoError(t, err)
	for _, b := range proxiedBeginners(t, e) {
		if b.store.Dialect() != sqldb.PostgreSQL {
			continue // no deferred triggers on MariaDB
		}
		for _, branch := range []struct {
			note, waitEvent string
			calls           int32
		}{{"lock", "advisory", 1}, {"sleep", "PgSleep", 2}} {
			t.Run(b.name+"/"+map[string]string{"lock": "committed", "sleep": "aborted"}[branch.note], func(t *testing.T) {
				ctx := context.Background()
				idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b.beginner, Store: b.store, Consumer: "commit-" + b.name}, nil)
				require.NoError(t, err)
				holder, err := e.pool.Acquire(ctx)
				require.NoError(t, err)
				defer holder.Release()
				if branch.note == "lock" {
					_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, key)
					require.NoError(t, err)
					defer func() { _, _ = holder.Exec(ctx, `SELECT pg_advisory_unlock_all()`) }()
				}
				logger := watermill.NewCaptureLogger()
				poison := &capture{msgs: make(chan *message.Message, 1)}
				var calls atomic.Int32
				id := uuid.Must(uuid.NewV7()).String()
				cut := make(chan struct{})
				go func() {
					defer close(cut)
					testenv.Eventually(t, 30*time.Second, "the attempt's session waiting inside COMMIT", func(o *testenv.Observed) bool {
						return o.Int("sessions in COMMIT", e.count(`SELECT count(*) FROM pg_stat_activity
							WHERE application_name = $1 AND wait_event = $2 AND query ILIKE 'commit%'`, e.schema, branch.waitEvent)) == 1
					})
					if branch.note == "lock" {
						// The client's cancel request (pgconn sends one when it
						// closes a connection it lost mid-query) must not reach
						// the COMMIT before it is done: the proxy holds it (and
						// the held re-run's statements) until the claim is
						// committed, seen on the test's own connection.
						b.proxy.Hang()
						defer b.proxy.Resume()
						b.proxy.Cut()
						_, _ = holder.Exec(ctx, `SELECT pg_advisory_unlock_all()`) // the server completes the COMMIT
						testenv.Eventually(t, 30*time.Second, "the claim committed by the server", func(o *testenv.Observed) bool {
							return o.Int("claims", e.processed(id)) == 1
						})
						return
					}
					b.proxy.Cut()
				}()
				h := chainedHold(t, idem, poison, logger, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
					note := "x"
					if calls.Add(1) == 1 {
						note = branch.note
					}
					q, _ := inbox.QuerierFromContext(msg.Context())
					_, err := q.Exec(msg.Context(), b.insert, msg.UUID, note)
					return nil, err
				})
				_, err = h(newMsg(id))
				<-cut
				require.NoError(t, err)
				require.Empty(t, poison.msgs, "never poisoned")
				require.Equal(t, 1, e.effects(id))
				require.Equal(t, 1, e.processed(id))
				require.Equal(t, branch.calls, calls.Load())
				held := logged(logger, watermill.InfoLogLevel, "Infrastructure failure: delivery held, not poisoned")
				require.NotEmpty(t, held, "the unknown COMMIT was held, not acked")
				require.ErrorIs(t, held[0].Fields["error"].(error), inbox.ErrCommit)
			})
		}
	}
}
