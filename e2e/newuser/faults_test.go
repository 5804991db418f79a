package newuser_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// dbProxy puts a fault proxy between the service and PostgreSQL: the
// service's database URL goes through it from now on.
func (e *env) dbProxy() *faultproxy.Proxy {
	e.t.Helper()
	u, err := url.Parse(e.dbURL)
	if err != nil {
		e.t.Fatal(err)
	}
	p, err := faultproxy.Start(u.Host)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = p.Close() })
	u.Host = net.JoinHostPort("127.0.0.1", fmt.Sprint(p.Port()))
	e.dbURL = u.String()
	return p
}

// countLines counts the lines at level whose message starts with prefix.
func (c *capture) countLines(level, prefix string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, l := range c.lines {
		if l.level == level && strings.HasPrefix(l.msg, prefix) {
			n++
		}
	}
	return n
}

// A long database outage (every connection cut, new ones refused) while
// events arrive, with MaxHold short enough that deliveries are held, nacked
// and redelivered several times during it: nothing is poisoned, nothing is
// applied during the outage, and each event is applied once after it.
func TestLongDatabaseOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	proxy := e.dbProxy()
	e.start(e.n, wiring{retry: func(c *middleware.RetryConfig) { c.MaxHold = 2 * time.Second }})
	proxy.Refuse(time.Hour)
	for i := 0; i < 5; i++ {
		e.order(fmt.Sprintf("O%d", i), 1)
	}
	// Held, given back (MaxHold), redelivered and held again, several times.
	testenv.Eventually(t, 90*time.Second, "deliveries held through several MaxHolds", func(o *testenv.Observed) bool {
		return o.Int("held", e.logs.countLines("INFO", "Infrastructure failure")) >= 15
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != 0 {
		t.Fatalf("%d reservations during the outage", n)
	}
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered during the outage", n)
	}
	proxy.Restore()
	testenv.Eventually(t, 90*time.Second, "every event applied after the outage", func(o *testenv.Observed) bool {
		return o.Int("reservations", e.count(`SELECT count(DISTINCT order_id) FROM reservation`)) == 5
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != 5 {
		t.Fatalf("%d reservations for 5 events", n)
	}
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered", n)
	}
}

// A failover: the primary becomes read-only (a private server whose
// default_transaction_read_only is switched on and off with ALTER SYSTEM
// and a reload, its sessions ended at the switch to read-only, as a
// demoted primary or a standby answers 25006) while
// events arrive: held, never poisoned, applied once when it is writable
// again.
func TestFailoverReadOnly(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	e := newEnvOn(t, pg.URL)
	e.start(e.n, wiring{})
	admin, err := pgx.Connect(context.Background(), pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	setReadOnly := func(on bool) {
		t.Helper()
		stmt := `ALTER SYSTEM RESET default_transaction_read_only`
		if on {
			stmt = `ALTER SYSTEM SET default_transaction_read_only = on`
		}
		qs := []string{`SET default_transaction_read_only = off`, stmt, `SELECT pg_reload_conf()`}
		if on {
			// A backend idle at the reload applies it only after its next
			// command: a transaction begun by that command was still
			// writable (one reservation committed under load). The
			// service's sessions are ended, as a failover ends them; the
			// new ones read the new setting.
			qs = append(qs, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'`)
		}
		for _, q := range qs {
			if _, err := admin.Exec(context.Background(), q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		e.pool.Reset() // the test's own reads, on sessions of their own
	}
	setReadOnly(true)
	for i := 0; i < 3; i++ {
		e.order(fmt.Sprintf("O%d", i), 2)
	}
	testenv.Eventually(t, 60*time.Second, "deliveries held on 25006", func(o *testenv.Observed) bool {
		return o.Int("held", len(grep(e.logs.all("INFO"), "25006"))) >= 3
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != 0 {
		t.Fatalf("%d reservations on a read-only server", n)
	}
	setReadOnly(false)
	testenv.Eventually(t, 60*time.Second, "every event applied once writable", func(o *testenv.Observed) bool {
		return o.Int("orders", e.count(`SELECT count(DISTINCT order_id) FROM reservation`)) == 3 &&
			o.Int("settled", e.logs.settledDeliveries()) == 6
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != 3 {
		t.Fatalf("%d reservations for 3 events", n)
	}
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered", n)
	}
}

func grep(lines []string, sub string) []string {
	var out []string
	for _, l := range lines {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return out
}

// The README's producer side (outbox + relay) feeding the README's
// consumer while a transaction elsewhere on the server holds an xid
// (BEGIN; SELECT pg_current_xact_id(); left open, as a stuck session
// does): every order reaches the consumer and is applied once; then an
// operator replays the range, and nothing is applied again.
func TestRelayWithAStuckTransactionElsewhere(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stuck, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close(context.Background())
	stx, err := stuck.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stx.Rollback(context.Background()) }()
	if _, err := stx.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
		t.Fatal(err)
	}

	e.start(e.n, wiring{})
	// The README's producer snippet.
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool), Table: "orders_outbox"}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	relay, err := ob.NewRelay(e.pub, outbox.RelayConfig{Retention: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	const orders = 10
	written := time.Now()
	for i := 0; i < orders; i++ {
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := ob.PgxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := marshaler.NewMessage("order.order.placed.v1", map[string]string{"order_id": fmt.Sprintf("O%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish(e.n.Topic, msg); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 60*time.Second, "every order applied behind the stuck transaction", func(o *testenv.Observed) bool {
		return o.Int("orders", e.count(`SELECT count(DISTINCT order_id) FROM reservation`)) == orders
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != orders {
		t.Fatalf("%d reservations for %d orders", n, orders)
	}
	// An operator replays the range (the stuck transaction still open):
	// every event arrives again with its event id and is skipped.
	// The consumer may apply an event before the relay's own transaction
	// (which archives the relayed rows) commits: replay only what is archived.
	testenv.Eventually(t, 60*time.Second, "the relay committed every relayed row", func(o *testenv.Observed) bool {
		n, err := ob.Pending(ctx)
		return err == nil && o.Int("pending", n) == 0
	})
	settled := e.logs.settledDeliveries()
	n, err := ob.Replay(ctx, wsql.TxFromPgx(mustBegin(t, e.pool)), e.pub, outbox.ReplayFilter{From: written.Add(-time.Second), To: time.Now().Add(time.Second)})
	if err != nil || n != orders {
		t.Fatalf("replay: %d events, %v", n, err)
	}
	testenv.Eventually(t, 60*time.Second, "every replayed event settled", func(o *testenv.Observed) bool {
		return o.Int("settled", e.logs.settledDeliveries()) >= settled+orders
	})
	if n := e.count(`SELECT count(*) FROM reservation`); n != orders {
		t.Fatalf("after the replay: %d reservations for %d orders", n, orders)
	}
	cancel()
	select {
	case <-relayDone:
	case <-time.After(30 * time.Second):
		t.Fatal("relay did not stop")
	}
}

// README: "Database outages don't poison, and don't spend the delivery
// limit … the chain holds the delivery and re-runs it in place … so a
// quorum queue's x-delivery-limit is not spent by an outage". The README's
// quorum queue with x-delivery-limit 1 (a message nacked twice is dropped:
// no dead-letter exchange on it) through a 10 s outage: every event is
// applied once afterwards, each at its first delivery (no x-delivery-count,
// not redelivered). The middleware tests' outage test uses a classic
// queue and checks no ack and no poison, so a chain that nacked each
// failed attempt would pass it; this one fails then.
func TestOutageDoesNotSpendTheDeliveryLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	proxy := e.dbProxy()
	var mu sync.Mutex
	counts := map[string]string{}
	e.start(e.n, wiring{
		subscriber: func(c *amqp.Config) { c.Queue.Arguments["x-delivery-limit"] = 1 },
		handler: func(msg *message.Message, orderID string) error {
			mu.Lock()
			counts[orderID] = msg.Metadata.Get(marshaler.MetadataDeliveryCount) + "/" + msg.Metadata.Get(marshaler.MetadataRedelivered)
			mu.Unlock()
			return insertNote(msg, orderID, "")
		},
	})
	proxy.Refuse(time.Hour)
	for i := 0; i < 3; i++ {
		e.order(fmt.Sprintf("O%d", i), 1)
	}
	testenv.Eventually(t, 60*time.Second, "held through the outage", func(o *testenv.Observed) bool {
		return o.Int("held", e.logs.countLines("INFO", "Infrastructure failure")) >= 8
	})
	proxy.Restore()
	testenv.Eventually(t, 60*time.Second, "every event applied after the outage", func(o *testenv.Observed) bool {
		return o.Int("orders", e.count(`SELECT count(DISTINCT order_id) FROM reservation`)) == 3
	})
	mu.Lock()
	defer mu.Unlock()
	for id, c := range counts {
		if c != "/false" && c != "0/false" {
			t.Errorf("%s applied at delivery count/redelivered %s: the outage spent deliveries", id, c)
		}
	}
}

// The producer's newcomer mistake: a message built with Watermill's
// message.NewMessage(watermill.NewUUID(), payload) (no event name, no
// occurred_at) instead of marshaler.NewMessage, written to the outbox. It
// could never be relayed as an envelope: refused when written (the
// transaction can roll back), never a row that blocks its topic.
func TestProducerMessageWithoutEnvelopeIsRefusedAtWrite(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool), Table: "orders_outbox"}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	pub, err := ob.PgxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	err = pub.Publish(e.n.Topic, message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"Z"}`)))
	if err == nil {
		t.Fatalf("outbox accepted a message without event name: the relay cannot publish it as an envelope")
	}
	t.Logf("refused: %v", err)
}

// mustBegin opens a read transaction for the replay, rolled back at the end.
func mustBegin(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// The README's producer writes one order whose envelope is over the
// marshaler's 1 MiB limit (an order with many lines: the outbox takes it,
// idamqp.Marshaler refuses to publish it), then an ordinary order on the
// same topic, the only topic of this outbox. README: "A bad row does not
// wedge it … after MaxAttempts the next row of its topic is published as a
// probe; if the broker takes it, the failing row moves to <table>_dead …
// and the rest follow in order".
//
// Symptom (proven on RabbitMQ 3.10 + PostgreSQL 15, MaxAttempts 3): the
// ordinary order is never published; the bad row's attempts climb past
// MaxAttempts forever (20 in 30 s under -race, logged at INFO "outbox row publish
// failed, will retry"), nothing is dead-lettered. Cause (outbox/relay.go):
// the probe is only chosen while the head is waiting (q.waiting:
// next_try_us > now, relay.go round: probes from heads), but after a round
// that published nothing Run sleeps backoff(failures) (relay.go:230-232),
// which equals the head's own retry delay (backoff(attempts-1)): the relay
// wakes exactly when the head is due again, claims it first (ORDER BY id),
// fails it and blocks its topic, so the probe round never happens. With
// another topic publishing (PoisonRowDeadLettered) the relay polls every
// 50 ms and the probe runs; with one topic it never does.
func TestRelayOneOversizedRowWedgesItsTopic(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.start(e.n, wiring{})
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool), Table: "orders_outbox"}, e.logs)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ob.PgxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	big, err := marshaler.NewMessage("order.order.placed.v1", map[string]string{"order_id": "BIG", "lines": strings.Repeat("x", 2<<20)})
	if err != nil {
		t.Fatal(err)
	}
	good, err := marshaler.NewMessage("order.order.placed.v1", map[string]string{"order_id": "G"})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(e.n.Topic, big, good); err != nil {
		t.Fatalf("outbox write: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relay, err := ob.NewRelay(e.pub, outbox.RelayConfig{
		Retention: 24 * time.Hour, RetryInterval: 10 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, MaxAttempts: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	defer func() {
		cancel()
		<-relayDone
	}()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) { // polling
		if e.reservations("G") == 1 {
			dead, err := ob.DeadLetters(ctx)
			if err != nil || dead != 1 {
				t.Fatalf("dead letters %d, %v; want the oversized row", dead, err)
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	dead, _ := ob.DeadLetters(ctx)
	t.Fatalf("one oversized row wedged its topic: the order behind it was not relayed in 30 s (MaxAttempts 3); %d failed attempts logged, dead letters: %d",
		e.logs.countLines("INFO", "outbox row publish failed"), dead)
}
