package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

const childEnv = "OUTBOX_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChildRelay())
	}
	os.Exit(m.Run())
}

// sent is one message the fake broker took.
type sent struct {
	topic string
	uuid  string
	body  string
	md    message.Metadata
}

// sink is a fake broker: it records each publish; refuse, when set, makes
// Publish fail for the messages it returns an error for.
type sink struct {
	mu     sync.Mutex
	got    []sent
	probes int // probe messages taken (outbox.DefaultProbeTopic), not in got
	refuse func(topic string, m *message.Message) error
}

func (s *sink) Publish(topic string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		if s.refuse != nil {
			if err := s.refuse(topic, m); err != nil {
				return err
			}
		}
		if topic == outbox.DefaultProbeTopic {
			s.probes++
			continue
		}
		md := message.Metadata{}
		for k, v := range m.Metadata {
			md[k] = v
		}
		s.got = append(s.got, sent{topic, m.UUID, string(m.Payload), md})
	}
	return nil
}

func (s *sink) Close() error { return nil }

func (s *sink) all() []sent {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]sent(nil), s.got...)
}

func (s *sink) count(id string) int {
	n := 0
	for _, g := range s.all() {
		if g.uuid == id {
			n++
		}
	}
	return n
}

func (s *sink) setRefuse(f func(string, *message.Message) error) {
	s.mu.Lock()
	s.refuse = f
	s.mu.Unlock()
}

// counts is a Recorder counting everything.
type counts struct {
	rounds, published, failed, dead atomic.Int64
	pressure                        atomic.Int64
	pending                         atomic.Int64
	oldest                          atomic.Int64
	reports                         atomic.Int64
}

func (c *counts) Round(n int)          { c.rounds.Add(1); c.published.Add(int64(n)) }
func (c *counts) PublishFailed(string) { c.failed.Add(1) }
func (c *counts) DeadLettered(string)  { c.dead.Add(1) }
func (c *counts) BackPressured(string) { c.pressure.Add(1) }
func (c *counts) Pending(n int, d time.Duration) {
	c.pending.Store(int64(n))
	c.oldest.Store(int64(d))
	c.reports.Add(1)
}

// box is one outbox on one contract target.
type box struct {
	table string
	tg    testenv.Target
	ob    *outbox.Outbox
	db    wsql.Beginner
}

func beginner(tg testenv.Target) wsql.Beginner {
	if tg.Pgx != nil {
		return wsql.BeginnerFromPgx(tg.Pgx)
	}
	return wsql.BeginnerFromStdSQL(tg.Std)
}

var boxes atomic.Int64

func newBox(t *testing.T, tg testenv.Target) *box {
	t.Helper()
	table := fmt.Sprintf("ob_%d", boxes.Add(1))
	ob, err := outbox.New(outbox.Config{Table: table, DB: tg.Handle()}, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(context.Background()))
	require.NoError(t, ob.Migrate(context.Background()), "Migrate is idempotent")
	return &box{table: table, tg: tg, ob: ob, db: beginner(tg)}
}

// begin opens a producer transaction (rolled back at the end if still open).
func (b *box) begin(t *testing.T) (wsql.Tx, message.Publisher) {
	t.Helper()
	tx, err := b.db.BeginTx(context.Background(), nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	pub, err := b.ob.Publisher(tx)
	require.NoError(t, err)
	return tx, pub
}

// write commits one row per id, each in its own transaction, to topic.
func (b *box) write(t *testing.T, topic string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		tx, pub := b.begin(t)
		require.NoError(t, pub.Publish(topic, msg(id)))
		require.NoError(t, tx.Commit())
	}
}

func msg(id string) *message.Message {
	m := message.NewMessage(id, []byte(`{"id":"`+id+`"}`))
	m.Metadata.Set("event_name", "order.placed")
	m.Metadata.Set("occurred_at", "2024-07-01T10:00:00.000Z")
	return m
}

func newID() string { return uuid.Must(uuid.NewV7()).String() }

func (b *box) relay(t *testing.T, dest message.Publisher, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 5 * time.Millisecond
	}
	r, err := b.ob.NewRelay(dest, cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, r.Close())
		require.NoError(t, <-done)
	})
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("relay stopped: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("relay did not start")
	}
	return r
}

func (b *box) pending(t *testing.T) int {
	t.Helper()
	n, err := b.ob.Pending(context.Background())
	require.NoError(t, err)
	return n
}

func (b *box) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+b.tg.Quote(table)).Scan(&n))
	return n
}

func eventually(t *testing.T, within time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s: %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestContract runs the outbox contract on every database.
func TestContract(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		t.Run("WriteInTxThenRelay", func(t *testing.T) { testWriteInTxThenRelay(t, newBox(t, tg)) })
		t.Run("C13_OutOfOrderCommits", func(t *testing.T) { testOutOfOrderCommits(t, tg) })
		t.Run("CrashBetweenPublishAndDelete", func(t *testing.T) { testCrash(t, newBox(t, tg)) })
		t.Run("PoisonRowDeadLettered", func(t *testing.T) { testPoison(t, newBox(t, tg)) })
		t.Run("PermanentDeadLetteredAtOnce", func(t *testing.T) { testPermanent(t, newBox(t, tg)) })
		t.Run("BrokerOutageDeadLettersNothing", func(t *testing.T) { testOutage(t, newBox(t, tg)) })
		t.Run("OutageAfterSuccessDeadLettersNothing", func(t *testing.T) { testOutageAfterSuccess(t, newBox(t, tg)) })
		t.Run("RetentionAndReplay", func(t *testing.T) { testReplay(t, newBox(t, tg)) })
		t.Run("OrderWithStandbyRelays", func(t *testing.T) { testOrder(t, newBox(t, tg)) })
		t.Run("StatsAndStallWarning", func(t *testing.T) { testStats(t, newBox(t, tg)) })
	})
}

// TestRelayBehindOpenTransaction (N07) — the outbox relay behind a transaction
// that stays open elsewhere, on every database (see testN07).
func TestRelayBehindOpenTransaction(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, testN07)
}

// A message written in a transaction exists only if it commits; the relay
// publishes it with its UUID, payload and metadata and removes the row.
func testWriteInTxThenRelay(t *testing.T, b *box) {
	tx, pub := b.begin(t)
	rolledBack := newID()
	require.NoError(t, pub.Publish("events", msg(rolledBack)))
	require.NoError(t, tx.Rollback())
	kept := newID()
	b.write(t, "events", kept)
	require.Equal(t, 1, b.pending(t))
	tx, pub = b.begin(t)
	require.ErrorIs(t, pub.Publish("", msg(newID())), outbox.ErrEmptyTopic)
	require.NoError(t, tx.Rollback())

	s := &sink{}
	b.relay(t, s, outbox.RelayConfig{})
	eventually(t, 30*time.Second, func() bool { return len(s.all()) == 1 && b.pending(t) == 0 }, "relayed")
	got := s.all()[0]
	require.Equal(t, sent{"events", kept, `{"id":"` + kept + `"}`, message.Metadata{"event_name": "order.placed", "occurred_at": "2024-07-01T10:00:00.000Z"}}, got)
	require.Zero(t, s.count(rolledBack))
	require.Equal(t, 0, b.count(t, b.table), "the table at rest holds only pending rows")
	require.Equal(t, 0, b.count(t, b.table+"_relayed"), "no archive without Retention")
}

// C13 base, per database: tx A writes E1 and stays open; tx B writes E2 and
// commits; the relay publishes E2 while A is open; A commits; E1 follows.
// Nothing is skipped. (SQLite has one writer: A's open transaction holds
// the write lock, so there the relay waits for A and both follow in order.)
func testOutOfOrderCommits(t *testing.T, tg testenv.Target) {
	b := newBox(t, tg)
	s := &sink{}
	rec := &counts{}
	e1, e2 := newID(), newID()
	if tg.Dialect == sqldb.SQLite {
		b.write(t, "events", e1, e2)
		b.relay(t, s, outbox.RelayConfig{Recorder: rec})
		eventually(t, 30*time.Second, func() bool { return len(s.all()) == 2 }, "both relayed")
		require.Equal(t, []string{e1, e2}, []string{s.all()[0].uuid, s.all()[1].uuid})
		return
	}
	txA, pubA := b.begin(t)
	require.NoError(t, pubA.Publish("events", msg(e1)))
	b.write(t, "events", e2)
	b.relay(t, s, outbox.RelayConfig{Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return s.count(e2) == 1 }, "E2 relayed while tx A is open")
	n := rec.rounds.Load()
	eventually(t, 30*time.Second, func() bool { return rec.rounds.Load() >= n+2 }, "the relay runs on")
	require.Zero(t, s.count(e1))
	require.NoError(t, txA.Commit())
	eventually(t, 30*time.Second, func() bool { return s.count(e1) == 1 }, "E1, committed late, is relayed")
	n = rec.rounds.Load()
	eventually(t, 30*time.Second, func() bool { return rec.rounds.Load() >= n+2 }, "the relay runs twice more")
	require.Equal(t, 1, s.count(e1))
	require.Equal(t, 1, s.count(e2))
	require.Equal(t, 0, b.pending(t))
}

// otherDatabaseTx opens a write transaction in another database of the same
// server and keeps it open until the test ends: PostgreSQL "postgres"
// (BEGIN; SELECT pg_current_xact_id()), a fresh MariaDB database (an
// insert), another SQLite file (an insert: its write lock).
func otherDatabaseTx(t *testing.T, tg testenv.Target) {
	t.Helper()
	ctx := context.Background()
	switch tg.Dialect {
	case sqldb.PostgreSQL:
		u, err := url.Parse(testenv.PostgresURL())
		require.NoError(t, err)
		u.Path = "/postgres"
		conn, err := pgx.Connect(ctx, u.String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		var xid string
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))
	default:
		other := testenv.NewTarget(t, tg.Name, 2)
		if tg.Dialect == sqldb.SQLite {
			other = testenv.OpenTarget(t, tg.Name, filepath.Join(t.TempDir(), "other.db"), 2)
		}
		other.Exec(t, `CREATE TABLE busy (id int)`)
		tx := other.Begin(t)
		_, err := tx.Exec(ctx, `INSERT INTO busy (id) VALUES (1)`)
		require.NoError(t, err)
	}
}

// sameDatabaseTx opens a transaction in the outbox's own database that
// writes its own outbox row and stays open; it returns the row's commit.
func sameDatabaseTx(t *testing.T, b *box, id string) func() error {
	t.Helper()
	tx, pub := b.begin(t)
	if b.tg.Dialect == sqldb.PostgreSQL {
		_, err := tx.ExecContext(context.Background(), `SELECT pg_current_xact_id()`)
		require.NoError(t, err)
	}
	require.NoError(t, pub.Publish("events", msg(id)))
	return tx.Commit
}

// testN07: while session S keeps a write transaction open (in another
// database of the server, and in the same one with its own outbox row), a
// producer commits a row: it reaches the broker while S is still open (no
// waiting for S), and S's row, committed later, is not skipped.
func testN07(t *testing.T, tg testenv.Target) {
	b := newBox(t, tg)
	otherDatabaseTx(t, tg)
	var commitS func() error
	late := newID()
	if tg.Dialect != sqldb.SQLite { // SQLite: one writer per file
		commitS = sameDatabaseTx(t, b, late)
	}
	s := &sink{}
	b.relay(t, s, outbox.RelayConfig{})
	for i := 0; i < 3; i++ {
		id := newID()
		start := time.Now()
		b.write(t, "events", id)
		eventually(t, 30*time.Second, func() bool { return s.count(id) == 1 }, "delivered while S is open")
		t.Logf("delivered %s after %s with S open", id, time.Since(start))
	}
	if commitS != nil {
		require.Zero(t, s.count(late))
		require.NoError(t, commitS())
		eventually(t, 30*time.Second, func() bool { return s.count(late) == 1 }, "S's own row, committed later, is relayed")
	}
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
}

// Crash between publish and delete: a child relay publishes E1 to the fake
// broker (a table, so the publish outlives the child) and is SIGKILLed at
// the crash point before it deletes the row; the next relay publishes E1
// again with the same event_id.
func testCrash(t *testing.T, b *box) {
	brokerFile := filepath.Join(t.TempDir(), "broker")
	e1 := newID()
	b.write(t, "events", e1)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=relay", "OUTBOX_TARGET="+b.tg.Name, "OUTBOX_DATABASE="+b.tg.Database, "OUTBOX_TABLE="+b.table, "OUTBOX_BROKER="+brokerFile)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("child relay did not reach its crash point; output:\n%s", out.String())
	}
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child must die by SIGKILL: %s\n%s", cmd.ProcessState, out.String())
	published, err := os.ReadFile(brokerFile)
	require.NoError(t, err)
	require.Equal(t, e1+"\n", string(published), "the child published E1 (and nothing else)")
	require.Equal(t, 1, b.pending(t), "the child died before deleting the row")

	s := &sink{}
	b.relay(t, s, outbox.RelayConfig{})
	eventually(t, 30*time.Second, func() bool { return s.count(e1) == 1 && b.pending(t) == 0 }, "E1 republished")
}

// filePublisher is the child's broker: a line per message in a file, synced
// before Publish returns (the broker's confirm), so it outlives the child.
type filePublisher struct{ path string }

func (p filePublisher) Publish(_ string, msgs ...*message.Message) error {
	f, err := os.OpenFile(p.path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if _, err := f.WriteString(m.UUID + "\n"); err != nil {
			_ = f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func (p filePublisher) Close() error { return nil }

// runChildRelay runs a relay that SIGKILLs its process at the crash point.
func runChildRelay() int {
	t := &childTB{}
	tg := testenv.OpenTarget(t, os.Getenv("OUTBOX_TARGET"), os.Getenv("OUTBOX_DATABASE"), 2)
	if t.failed {
		return 2
	}
	ob, err := outbox.New(outbox.Config{Table: os.Getenv("OUTBOX_TABLE"), DB: tg.Handle()}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	crashpoint.Set(func(name string) {
		if name == crashpoint.OutboxAfterPublish {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	})
	// A short lease (2 × PublishTimeout): the next relay takes over soon
	// after the SIGKILL.
	r, err := ob.NewRelay(filePublisher{os.Getenv("OUTBOX_BROKER")}, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, PublishTimeout: 300 * time.Millisecond})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	_ = r.Run(context.Background())
	return 3
}

// childTB is the testing.TB testenv.OpenTarget needs in the child.
type childTB struct {
	testing.TB
	failed bool
}

func (c *childTB) Helper()        {}
func (c *childTB) Cleanup(func()) {}
func (c *childTB) Fatalf(f string, a ...any) {
	fmt.Fprintf(os.Stderr, f+"\n", a...)
	c.failed = true
	os.Exit(2)
}

var errRefused = errors.New("marshal: refused")

// A row the broker always refuses is retried MaxAttempts times with backoff
// while the rows of its topic behind it wait (per-topic order); then the next
// row is published as a probe, the broker takes it, so the refused row is
// moved to the dead-letter table, counted, logged at ERROR with its id and
// reason, and the rest follow in order. Rows of other topics never wait.
func testPoison(t *testing.T, b *box) {
	poison, good := newID(), []string{newID(), newID(), newID()}
	other := newID()
	b.write(t, "events", poison)
	b.write(t, "events", good...)
	b.write(t, "other", other)
	s := &sink{refuse: func(_ string, m *message.Message) error {
		if m.UUID == poison {
			return errRefused
		}
		return nil
	}}
	rec := &counts{}
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	b.relay(t, s, outbox.RelayConfig{MaxAttempts: 3, RetryInterval: 20 * time.Millisecond, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return s.count(other) == 1 }, "another topic is not held back")
	eventually(t, 30*time.Second, func() bool { return rec.dead.Load() == 1 }, "the poison row is dead-lettered")
	eventually(t, 30*time.Second, func() bool { return len(s.all()) == 4 }, "the rows behind it are published")
	var events []string
	for _, g := range s.all() {
		if g.topic == "events" {
			events = append(events, g.uuid)
		}
	}
	require.Equal(t, good, events, "in order, after the poison row was moved aside")
	more := newID()
	b.write(t, "events", more)
	eventually(t, 30*time.Second, func() bool { return s.count(more) == 1 }, "later rows flow")
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
	n, err := b.ob.DeadLetters(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.GreaterOrEqual(t, rec.failed.Load(), int64(3))
	var reason, id string
	var attempts int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT event_id, reason, attempts FROM `+b.table+`_dead`).Scan(&id, &reason, &attempts))
	require.Equal(t, poison, id)
	require.Equal(t, errRefused.Error(), reason)
	require.GreaterOrEqual(t, attempts, 3)
	var logged bool
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		if e.Msg == "outbox row dead-lettered" && e.Fields["event_id"] == poison && e.Fields["row_id"] != nil && e.Err != nil && e.Err.Error() == errRefused.Error() {
			logged = true
		}
	}
	require.True(t, logged, "ERROR log with the row id and reason")
}

// A row whose error RelayConfig.Permanent classifies as permanent is
// dead-lettered at its first failure, even with no successful publish yet.
func testPermanent(t *testing.T, b *box) {
	bad := newID()
	b.write(t, "events", bad)
	s := &sink{refuse: func(string, *message.Message) error { return fmt.Errorf("encode: %w", errRefused) }}
	rec := &counts{}
	b.relay(t, s, outbox.RelayConfig{Recorder: rec, Permanent: func(err error) bool { return errors.Is(err, errRefused) }})
	eventually(t, 30*time.Second, func() bool { return rec.dead.Load() == 1 }, "dead-lettered")
	require.EqualValues(t, 1, rec.failed.Load())
	require.Equal(t, 0, b.pending(t))
	var attempts int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT attempts FROM `+b.table+`_dead`).Scan(&attempts))
	require.Equal(t, 1, attempts)
}

// While every publish fails (the broker is down) no row is dead-lettered,
// however many attempts; after recovery all are published in order.
func testOutage(t *testing.T, b *box) {
	ids := []string{newID(), newID(), newID()}
	b.write(t, "events", ids...)
	var down atomic.Bool
	down.Store(true)
	s := &sink{refuse: func(string, *message.Message) error {
		if down.Load() {
			return errors.New("connection refused")
		}
		return nil
	}}
	rec := &counts{}
	b.relay(t, s, outbox.RelayConfig{MaxAttempts: 2, RetryInterval: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 12 }, "the relay keeps trying")
	require.Zero(t, rec.dead.Load())
	down.Store(false)
	eventually(t, 30*time.Second, func() bool { return len(s.all()) == 3 }, "all published after recovery")
	require.Equal(t, ids, []string{s.all()[0].uuid, s.all()[1].uuid, s.all()[2].uuid})
	require.Zero(t, rec.dead.Load())
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "nothing pending")
}

// A row fails while the broker is up (another row goes through), then the
// broker goes down: attempts during the outage are not the row's fault, so
// it is not dead-lettered however many it uses; after the outage it is
// published. (A rule "some publish succeeded since the row's first
// failure" would dead-letter it during the outage.)
func testOutageAfterSuccess(t *testing.T, b *box) {
	x, y := newID(), newID()
	b.write(t, "a", x)
	var down atomic.Bool
	s := &sink{}
	s.refuse = func(topic string, m *message.Message) error {
		switch {
		case down.Load():
			return errors.New("connection refused")
		case m.UUID == x:
			return errors.New("transient")
		}
		return nil
	}
	rec := &counts{}
	// x's retries while the broker is up count: slow enough that it is not
	// dead-lettered before the outage begins, even on a loaded machine.
	b.relay(t, s, outbox.RelayConfig{MaxAttempts: 3, RetryInterval: 300 * time.Millisecond, MaxBackoff: 300 * time.Millisecond, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 1 && b.nextTry(t) != 0 }, "x failed once, broker up")
	b.write(t, "b", y) // published after x's first failure: the broker is up
	eventually(t, 30*time.Second, func() bool { return s.count(y) == 1 }, "y published")
	down.Store(true) // then the outage begins
	n := rec.failed.Load()
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= n+2 }, "x failing in the outage")
	attempts := func() int {
		var a int
		require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT attempts FROM `+b.tg.Quote(b.table)).Scan(&a))
		return a
	}
	before := attempts()
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= n+8 || rec.dead.Load() > 0 }, "x retried well past MaxAttempts during the outage")
	require.Zero(t, rec.dead.Load(), "no dead letter during the outage")
	require.Equal(t, before, attempts(), "failures during the outage are not x's attempts")
	s.setRefuse(nil)
	down.Store(false)
	eventually(t, 30*time.Second, func() bool { return s.count(x) == 1 }, "x published after the outage")
	require.Zero(t, rec.dead.Load())
}

// With Retention the relayed rows move to the archive (the outbox table
// holds only pending rows); Replay republishes a write-time range with the
// original ids, filtered by topic, or counts it (DryRun); the archive is
// purged after the retention.
func testReplay(t *testing.T, b *box) {
	// Write times are the database's clock (SQLite's: the process clock,
	// in microseconds; another server's may differ a little from ours, so
	// the bounds keep two milliseconds clear of the writes).
	t0 := time.Now().Add(-2 * time.Millisecond)
	a1, a2, c1 := newID(), newID(), newID()
	b.write(t, "a", a1, a2)
	b.write(t, "c", c1)
	t1 := time.Now()
	for time.Since(t1) < 2*time.Millisecond {
		time.Sleep(time.Millisecond)
	}
	late := newID()
	b.write(t, "a", late)
	s := &sink{}
	b.relay(t, s, outbox.RelayConfig{Retention: time.Hour})
	eventually(t, 30*time.Second, func() bool { return len(s.all()) == 4 }, "relayed")
	require.Equal(t, 0, b.count(t, b.table))
	require.Equal(t, 4, b.count(t, b.table+"_relayed"))

	ctx := context.Background()
	n, err := b.ob.Replay(ctx, b.db, nil, outbox.ReplayFilter{From: t0, To: t1, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	r := &sink{}
	n, err = b.ob.Replay(ctx, b.db, r, outbox.ReplayFilter{From: t0, To: t1, Topics: []string{"a"}})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []sent{s.all()[0], s.all()[1]}, r.all(), "same ids, payloads, metadata, in outbox order")
	_, err = b.ob.Replay(ctx, b.db, r, outbox.ReplayFilter{From: t1, To: t0})
	require.Error(t, err)

	// Purge: a relay with a short retention empties the archive.
	b2 := &box{tg: b.tg, ob: b.ob, db: b.db}
	b2.relay(t, &sink{}, outbox.RelayConfig{Retention: time.Nanosecond, StatsInterval: 5 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return b.count(t, b.table+"_relayed") == 0 }, "archive purged after the retention")
}

// Two relays on one outbox (the default): one publishes at a time, so 200
// rows written in order reach the broker in id order, each once. With
// Parallel, each row is published (order across batches not kept).
func testOrder(t *testing.T, b *box) {
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = newID()
	}
	// One transaction writes them all, in order.
	tx, pub := b.begin(t)
	for _, id := range ids {
		require.NoError(t, pub.Publish("events", msg(id)))
	}
	require.NoError(t, tx.Commit())
	s := &sink{}
	var standby []*outbox.Relay
	for i := 0; i < 2; i++ {
		standby = append(standby, b.relay(t, s, outbox.RelayConfig{BatchSize: 7}))
	}
	eventually(t, 60*time.Second, func() bool { return len(s.all()) == len(ids) && b.pending(t) == 0 }, "all relayed")
	got := make([]string, 0, len(ids))
	for _, g := range s.all() {
		got = append(got, g.uuid)
	}
	require.Equal(t, ids, got, "id order, each once")

	if b.tg.Dialect == sqldb.SQLite {
		_, err := b.ob.NewRelay(s, outbox.RelayConfig{Parallel: true})
		require.Error(t, err)
		return
	}
	for _, r := range standby {
		require.NoError(t, r.Close())
	}
	more := make([]string, 100)
	for i := range more {
		more[i] = newID()
	}
	b.write(t, "events", more...)
	p := &sink{}
	for i := 0; i < 2; i++ {
		b.relay(t, p, outbox.RelayConfig{BatchSize: 5, Parallel: true})
	}
	eventually(t, 60*time.Second, func() bool { return len(p.all()) >= len(more) && b.pending(t) == 0 }, "parallel relays drain")
	seen := map[string]bool{}
	for _, g := range p.all() {
		seen[g.uuid] = true
	}
	sort.Strings(more)
	for _, id := range more {
		require.True(t, seen[id])
	}
}

// The relay reports pending rows and the oldest one's age, and warns when
// it is older than StalledAfter (here: a refused row retried slowly).
func testStats(t *testing.T, b *box) {
	stuck := newID()
	b.write(t, "events", stuck)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	b.ob = ob
	rec := &counts{}
	s := &sink{refuse: func(string, *message.Message) error { return errRefused }}
	b.relay(t, s, outbox.RelayConfig{StatsInterval: 5 * time.Millisecond, StalledAfter: time.Millisecond, Recorder: rec, RetryInterval: time.Hour, MaxBackoff: time.Hour})
	// The refusal puts the relay in an hour's backoff: the stats go on
	// meanwhile, every StatsInterval (they once waited for the backoff,
	// so a stall behind a down broker was reported MaxBackoff late).
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 1 }, "the refused publish")
	after := rec.reports.Load()
	eventually(t, 30*time.Second, func() bool { return rec.reports.Load() >= after+3 }, "stats reported during the backoff")
	eventually(t, 30*time.Second, func() bool { return rec.pending.Load() == 1 && rec.oldest.Load() > int64(time.Millisecond) }, "pending 1 reported with its age")
	eventually(t, 30*time.Second, func() bool {
		for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
			if errors.Is(e.Err, outbox.ErrStalled) {
				return true
			}
		}
		return false
	}, "stall logged")
	require.Zero(t, rec.dead.Load())
}

var _ = sql.ErrNoRows

func beginnerPgx(pool interface {
	wsql.Conn
}) wsql.Beginner {
	return wsql.BeginnerFromPgx(pool)
}
