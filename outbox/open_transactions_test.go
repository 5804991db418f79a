package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand"
	"net/url"
	"path/filepath"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// session is one dedicated connection that an open-transaction test keeps in a
// transaction; it is rolled back and closed when the test ends.
type session struct {
	t    *testing.T
	conn *sql.Conn
}

// openSession connects to dsn with driver and runs stmts on the connection.
func openSession(t *testing.T, driver, dsn string, stmts ...string) *session {
	t.Helper()
	db, err := sql.Open(driver, dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	conn, err := db.Conn(context.Background())
	require.NoError(t, err)
	s := &session{t: t, conn: conn}
	t.Cleanup(func() {
		_, _ = conn.ExecContext(context.Background(), "ROLLBACK")
		_ = conn.Close()
	})
	s.exec(stmts...)
	return s
}

func (s *session) exec(stmts ...string) {
	s.t.Helper()
	for _, q := range stmts {
		_, err := s.conn.ExecContext(context.Background(), q)
		require.NoError(s.t, err, q)
	}
}

// dsnOf is the database/sql driver and DSN of a target's database (or,
// other != "", of another database on the same server).
func dsnOf(tg testenv.Target, other string) (string, string) {
	switch tg.Dialect {
	case sqldb.PostgreSQL:
		if other == "" {
			return "pgx", testenv.SchemaURL(tg.Database)
		}
		u, _ := url.Parse(testenv.PostgresURL())
		u.Path = "/" + other
		return "pgx", u.String()
	case sqldb.MySQL:
		if other == "" {
			other = tg.Database
		}
		return "mysql", testenv.MySQLDatabaseDSN(other)
	default: // SQLite: deferred BEGIN (a reader in WAL does not block the writer)
		path := tg.Database
		if other != "" {
			path = other
		}
		return "sqlite", "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)"
	}
}

// openTx is a transaction another session keeps open while the relay
// runs; lateRow, when set, is an outbox row it wrote, committed at the end.
type openTx struct {
	name string
	open func(t *testing.T, b *box, lateRow string) (commit func())
}

// openTransactions returns the open transactions of N07 for tg's dialect.
func openTransactions(tg testenv.Target) []openTx {
	insertLate := func(t *testing.T, s *session, b *box, id string) {
		md := `{"event_name":"order.placed"}`
		q := b.tg.Rebind(`INSERT INTO ` + b.tg.Quote(b.table) + ` (event_id, topic, payload, metadata, created_at_us) VALUES ($1, $2, $3, $4, $5)`)
		_, err := s.conn.ExecContext(context.Background(), q, id, "events", []byte(`{"id":"`+id+`"}`), md, time.Now().UnixMicro())
		require.NoError(t, err)
	}
	switch tg.Dialect {
	case sqldb.PostgreSQL:
		return []openTx{
			{"SameDB/ReadSnapshot", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "")
				openSession(t, d, dsn, "BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM "+b.table)
				return nil
			}},
			{"SameDB/WrittenRowElsewhere", func(t *testing.T, b *box, _ string) func() {
				b.tg.Exec(t, `CREATE TABLE busy (id int)`)
				d, dsn := dsnOf(b.tg, "")
				openSession(t, d, dsn, "BEGIN", "INSERT INTO busy VALUES (1)")
				return nil
			}},
			{"SameDB/OwnOutboxRow", func(t *testing.T, b *box, late string) func() {
				d, dsn := dsnOf(b.tg, "")
				s := openSession(t, d, dsn, "BEGIN")
				insertLate(t, s, b, late)
				return func() { s.exec("COMMIT") }
			}},
			{"OtherDB/Snapshot", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "postgres")
				openSession(t, d, dsn, "BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM pg_class")
				return nil
			}},
			{"OtherDB/Xid", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "postgres")
				openSession(t, d, dsn, "BEGIN", "SELECT pg_current_xact_id()")
				return nil
			}},
			{"OtherDB/WrittenRow", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "postgres")
				openSession(t, d, dsn, "BEGIN", "CREATE TEMP TABLE busy (id int) ON COMMIT DROP", "INSERT INTO busy VALUES (1)")
				return nil
			}},
		}
	case sqldb.MySQL:
		return []openTx{
			{"SameDB/ConsistentSnapshot", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "")
				openSession(t, d, dsn, "START TRANSACTION WITH CONSISTENT SNAPSHOT", "SELECT count(*) FROM "+b.tg.Quote(b.table))
				return nil
			}},
			{"SameDB/WrittenRowElsewhere", func(t *testing.T, b *box, _ string) func() {
				b.tg.Exec(t, `CREATE TABLE busy (id int)`)
				d, dsn := dsnOf(b.tg, "")
				openSession(t, d, dsn, "BEGIN", "INSERT INTO busy VALUES (1)")
				return nil
			}},
			{"SameDB/OwnOutboxRow", func(t *testing.T, b *box, late string) func() {
				d, dsn := dsnOf(b.tg, "")
				s := openSession(t, d, dsn, "BEGIN")
				insertLate(t, s, b, late)
				return func() { s.exec("COMMIT") }
			}},
			{"SameDB/XAPrepared", func(t *testing.T, b *box, late string) func() {
				d, dsn := dsnOf(b.tg, "")
				xid := fmt.Sprintf("'%s'", testenv.UniqueName("xa"))
				s := openSession(t, d, dsn, "XA START "+xid)
				insertLate(t, s, b, late)
				s.exec("XA END "+xid, "XA PREPARE "+xid)
				t.Cleanup(func() { _, _ = s.conn.ExecContext(context.Background(), "XA ROLLBACK "+xid) })
				return func() { s.exec("XA COMMIT " + xid) }
			}},
			{"OtherDB/Snapshot", func(t *testing.T, b *box, _ string) func() {
				other := testenv.MySQLDatabase(t)
				d, dsn := dsnOf(b.tg, other)
				openSession(t, d, dsn, "CREATE TABLE busy (id int)", "START TRANSACTION WITH CONSISTENT SNAPSHOT", "SELECT count(*) FROM busy")
				return nil
			}},
			{"OtherDB/WrittenRow", func(t *testing.T, b *box, _ string) func() {
				other := testenv.MySQLDatabase(t)
				d, dsn := dsnOf(b.tg, other)
				openSession(t, d, dsn, "CREATE TABLE busy (id int)", "BEGIN", "INSERT INTO busy VALUES (1)")
				return nil
			}},
		}
	default:
		return []openTx{
			{"SameFile/ReadTx", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, "")
				openSession(t, d, dsn, "BEGIN", "SELECT count(*) FROM "+b.tg.Quote(b.table))
				return nil
			}},
			{"OtherFile/WrittenRow", func(t *testing.T, b *box, _ string) func() {
				d, dsn := dsnOf(b.tg, filepath.Join(t.TempDir(), "other.db"))
				openSession(t, d, dsn, "CREATE TABLE busy (id int)", "BEGIN IMMEDIATE", "INSERT INTO busy VALUES (1)")
				return nil
			}},
		}
	}
}

// TestRelayDeliversWhileOtherTransactionsStayOpen (N07): while another session keeps a transaction open — in
// the outbox's database or another one of the server, reading (a snapshot)
// or having written (a row elsewhere, its own outbox row, an XA/2PC
// prepared transaction) — the relay keeps delivering rows committed
// meanwhile, and a row that session wrote is delivered once it commits.
func TestRelayDeliversWhileOtherTransactionsStayOpen(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		for _, h := range openTransactions(tg) {
			t.Run(h.name, func(t *testing.T) {
				b := newBox(t, tg)
				late := newID()
				commit := h.open(t, b, late)
				s := &sink{}
				b.relay(t, s, outbox.RelayConfig{})
				for i := 0; i < 3; i++ {
					id := newID()
					b.write(t, "events", id)
					eventually(t, 30*time.Second, func() bool { return s.count(id) == 1 }, "delivered while the session is open")
				}
				if commit != nil {
					require.Zero(t, s.count(late))
					commit()
					eventually(t, 30*time.Second, func() bool { return s.count(late) == 1 }, "its row, committed late, is delivered")
				}
				eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
			})
		}
	})
}

// TestRelayDeliversPastAPreparedTransaction (N07): a PostgreSQL prepared transaction (2PC,
// PREPARE TRANSACTION) that wrote an outbox row outlives its session and
// holds back the server's xmin; on a private server with
// max_prepared_transactions > 0, the relay keeps delivering meanwhile and
// delivers the prepared row after COMMIT PREPARED.
func TestRelayDeliversPastAPreparedTransaction(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t, "max_prepared_transactions=5")
	schema := testenv.SchemaOn(t, pg.URL)
	pool := testenv.PoolAt(t, pg.URL, schema, 4)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "ob_prepared"}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, ob.Migrate(ctx))
	db := wsql.BeginnerFromPgx(pool)
	late := newID()
	gid := testenv.UniqueName("gid")
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "BEGIN")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `INSERT INTO ob_prepared (event_id, topic, payload, metadata, created_at_us) VALUES ($1, 'events', '\x7b7d', '{}', 0)`, late)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "PREPARE TRANSACTION '"+gid+"'")
	require.NoError(t, err)
	conn.Release()
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "ROLLBACK PREPARED '"+gid+"'") })

	s := &sink{}
	r, err := ob.NewRelay(s, outbox.RelayConfig{PollInterval: 5 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() { _ = r.Close(); <-done })
	for i := 0; i < 3; i++ {
		id := newID()
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		pub, err := ob.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("events", msg(id)))
		require.NoError(t, tx.Commit())
		eventually(t, 30*time.Second, func() bool { return s.count(id) == 1 }, "delivered while a prepared transaction is pending")
	}
	require.Zero(t, s.count(late))
	_, err = pool.Exec(ctx, "COMMIT PREPARED '"+gid+"'")
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool { return s.count(late) == 1 }, "the prepared row is delivered after COMMIT PREPARED")
}

// TestLateCommitSeveralRelays: transactions commit out of id order (tx A
// writes before tx B, B commits, the relays run, A commits) while three
// relays (the default: one active, two standing by) run on handles whose
// sessions default to SERIALIZABLE / REPEATABLE READ, as do the producers:
// every row is delivered exactly once, A's included.
func TestLateCommitSeveralRelays(t *testing.T) {
	t.Parallel()
	for _, name := range []string{testenv.TargetPostgresStdlib, testenv.TargetMariaDB} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			tg := testenv.NewTarget(t, name, 8)
			b := newBox(t, tg)
			d, dsn := dsnOf(tg, "")
			iso := sql.LevelRepeatableRead
			if tg.Dialect == sqldb.PostgreSQL {
				dsn += "&default_transaction_isolation=serializable"
			} else {
				dsn += "&tx_isolation=" + url.QueryEscape("'SERIALIZABLE'")
			}
			strict, err := sql.Open(d, dsn)
			require.NoError(t, err)
			t.Cleanup(func() { _ = strict.Close() })
			relayDB := wsql.BeginnerFromStdSQL(strict)
			s := &sink{}
			for i := 0; i < 3; i++ {
				rb := &box{table: b.table, tg: tg, ob: b.ob, db: relayDB}
				rb.relay(t, s, outbox.RelayConfig{})
			}
			ctx := context.Background()
			beginRR := func() (*sql.Tx, message.Publisher) {
				tx, err := strict.BeginTx(ctx, &sql.TxOptions{Isolation: iso})
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				pub, err := b.ob.StdPublisher(tx)
				require.NoError(t, err)
				return tx, pub
			}
			var all []string
			for round := 0; round < 5; round++ {
				a, bID := newID(), newID()
				all = append(all, a, bID)
				txA, pubA := beginRR()
				require.NoError(t, pubA.Publish("events", msg(a)))
				txB, pubB := beginRR()
				require.NoError(t, pubB.Publish("events", msg(bID)))
				require.NoError(t, txB.Commit())
				eventually(t, 30*time.Second, func() bool { return s.count(bID) == 1 }, "B delivered while A is open")
				require.Zero(t, s.count(a))
				require.NoError(t, txA.Commit())
				eventually(t, 30*time.Second, func() bool { return s.count(a) == 1 }, "A, committed late, delivered")
			}
			eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
			for _, id := range all {
				require.Equal(t, 1, s.count(id), "once each")
			}
		})
	}
}

// TestPerTopicOrderSeveralRelays: four producers each write 40 events of
// their own topic one transaction after the other, while three relays
// (default) run and the broker refuses a random tenth of the publishes
// (retried): each topic's events reach the broker in write order, each
// once. And a committed row that another session holds a row lock on
// (SELECT … FOR UPDATE) is not overtaken by the rows of its topic behind it.
func TestPerTopicOrderSeveralRelays(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		t.Run("ConcurrentProducersFlakyBroker", func(t *testing.T) {
			b := newBox(t, tg)
			var mu sync.Mutex
			rnd := rand.New(rand.NewSource(1))
			s := &sink{refuse: func(topic string, m *message.Message) error {
				mu.Lock()
				defer mu.Unlock()
				if topic != outbox.DefaultProbeTopic && rnd.Intn(10) == 0 {
					return fmt.Errorf("broker: flaky")
				}
				return nil
			}}
			for i := 0; i < 3; i++ {
				b.relay(t, s, outbox.RelayConfig{BatchSize: 7, RetryInterval: time.Millisecond, MaxBackoff: 10 * time.Millisecond, MaxAttempts: 1000})
			}
			written := map[string][]string{}
			var wg sync.WaitGroup
			var wmu sync.Mutex
			for p := 0; p < 4; p++ {
				topic := fmt.Sprintf("topic%d", p)
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < 40; i++ {
						id := newID()
						tx, err := tg.BeginTx(context.Background())
						if err != nil {
							t.Error(err)
							return
						}
						md := `{"event_name":"order.placed"}`
						if _, err := tx.Exec(context.Background(), tg.Rebind(`INSERT INTO `+tg.Quote(b.table)+` (event_id, topic, payload, metadata, created_at_us) VALUES ($1, $2, $3, $4, 0)`), id, topic, []byte("{}"), md); err != nil {
							_ = tx.Rollback()
							t.Error(err)
							return
						}
						if err := tx.Commit(); err != nil {
							t.Error(err)
							return
						}
						wmu.Lock()
						written[topic] = append(written[topic], id)
						wmu.Unlock()
					}
				}()
			}
			wg.Wait()
			eventually(t, 90*time.Second, func() bool { return len(s.all()) == 160 && b.pending(t) == 0 }, "all delivered")
			got := map[string][]string{}
			for _, g := range s.all() {
				got[g.topic] = append(got[g.topic], g.uuid)
			}
			require.Equal(t, written, got, "per-topic write order, once each")
		})
		if tg.Dialect == sqldb.SQLite {
			return // one writer: no row locks to hold
		}
		t.Run("LockedRowNotOvertaken", func(t *testing.T) {
			b := newBox(t, tg)
			x, y, z := newID(), newID(), newID()
			b.write(t, "events", x, y)
			b.write(t, "other", z)
			d, dsn := dsnOf(tg, "")
			var xID int64
			require.NoError(t, tg.DB.QueryRow(context.Background(), tg.Rebind(`SELECT id FROM `+tg.Quote(b.table)+` WHERE event_id = $1`), x).Scan(&xID))
			// By primary key: on MariaDB a scan under REPEATABLE READ would lock every row.
			locker := openSession(t, d, dsn, "BEGIN", fmt.Sprintf("SELECT id FROM %s WHERE id = %d FOR UPDATE", tg.Quote(b.table), xID))
			s := &sink{}
			b.relay(t, s, outbox.RelayConfig{})
			b.relay(t, s, outbox.RelayConfig{})
			eventually(t, 30*time.Second, func() bool { return s.count(z) == 1 }, "another topic flows")
			require.Zero(t, s.count(y), "y must not overtake x, locked by another session")
			locker.exec("ROLLBACK")
			eventually(t, 30*time.Second, func() bool { return s.count(x) == 1 && s.count(y) == 1 }, "x then y after the lock is gone")
			var order []string
			for _, g := range s.all() {
				if g.topic == "events" {
					order = append(order, g.uuid)
				}
			}
			require.Equal(t, []string{x, y}, order)
		})
	})
}
