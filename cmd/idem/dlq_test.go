package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// Environment of the child process of the kill test (TestMain).
const (
	envChildArgs  = "IDEM_TEST_CHILD_ARGS"  // JSON array: the command's arguments
	envCrashAfter = "IDEM_TEST_CRASH_AFTER" // SIGKILL itself at the K-th crashAfterPublish
)

func TestMain(m *testing.M) {
	if raw := os.Getenv(envChildArgs); raw != "" {
		var args []string
		if err := json.Unmarshal([]byte(raw), &args); err != nil {
			os.Exit(100)
		}
		k, _ := strconv.Atoi(os.Getenv(envCrashAfter))
		var n atomic.Int32
		crashpoint.Set(func(name string) {
			if name == crashAfterPublish && k > 0 && int(n.Add(1)) == k {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // never returns
			}
		})
		os.Exit(Run(args, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// shop is one test's consumer side: a queue consumed by a router with the
// recommended chain (poison to the DLQ), a handler writing one effect row in
// the claim's transaction, and a switch that makes it fail permanently (the
// bug that filled the DLQ).
type shop struct {
	t        *testing.T
	schema   string
	pool     *pgxpool.Pool
	conn     *amqp091.Connection
	queue    string
	dlq      string
	cfg      wamqp.Config
	buggy    atomic.Bool
	calls    atomic.Int32
	outcomes *idempotencytest.Outcomes
}

const testConsumer = "stock"

func newShop(t *testing.T) *shop {
	t.Helper()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, sqldbPgx(pool)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL, at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s unreachable: %v", testenv.AMQPURL(), err)
	}
	s := &shop{t: t, schema: schema, pool: pool, conn: conn, queue: testenv.UniqueName("idem_q"), dlq: testenv.UniqueName("idem_dlq"),
		outcomes: &idempotencytest.Outcomes{}}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// The DLQ is a quorum queue, as in the shop's topology.
	if _, err := ch.QueueDeclare(s.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(s.dlq, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(s.queue, false, false, false)
			_, _ = ch.QueueDelete(s.dlq, false, false, false)
		}
		_ = conn.Close()
	})
	s.cfg = wamqp.NewDurableQueueConfig(testenv.AMQPURL())
	s.cfg.Marshaler = idemamqp.Marshaler{}
	s.cfg.Publish.ConfirmDelivery = true
	return s
}

// run starts the router; it stops when the test ends.
func (s *shop) run() {
	t := s.t
	logger := watermill.NopLogger{}
	sub, err := wamqp.NewSubscriber(s.cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	poisonPub, err := wamqp.NewPublisher(s.cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(s.pool, inbox.PgxBeginnerConfig{})),
		Consumer: testConsumer,
		Recorder: s.outcomes,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poisonPub, PoisonTopic: s.dlq,
		MaxRetries: 1, InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(chain...)
	router.AddNoPublisherHandler("stock", s.queue, sub, func(msg *message.Message) error {
		if s.buggy.Load() {
			return inbox.Permanent(errors.New("stock: unknown product sku-42"))
		}
		s.calls.Add(1)
		tx, ok := inbox.PgxTxFromContext(msg.Context())
		if !ok {
			return errors.New("no tx")
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return err
	})
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() { _ = router.Close(); <-done; _ = poisonPub.Close() })
}

// publish sends n events to the queue and returns their ids.
func (s *shop) publish(n int) []string {
	pub, err := wamqp.NewPublisher(s.cfg, watermill.NopLogger{})
	if err != nil {
		s.t.Fatal(err)
	}
	defer pub.Close()
	ids := make([]string, n)
	for i := range ids {
		m, err := marshaler.NewMessage("order.placed", map[string]any{"order": i, "sku": "sku-42"})
		if err != nil {
			s.t.Fatal(err)
		}
		if err := pub.Publish(s.queue, m); err != nil {
			s.t.Fatal(err)
		}
		ids[i] = m.UUID
	}
	return ids
}

func (s *shop) depth(q string) int {
	n, err := queueDepth(s.conn, q)
	if err != nil {
		s.t.Fatal(err)
	}
	return n
}

// eventually polls cond until it holds or 60 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (s *shop) effects() (rows, distinct int) {
	if err := s.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM effect`).Scan(&rows, &distinct); err != nil {
		s.t.Fatal(err)
	}
	return rows, distinct
}

// poisoned fills the DLQ with n events through the buggy handler and
// records the first applied of them as already processed by the consumer.
func (s *shop) poisoned(n, applied int) []string {
	s.buggy.Store(true)
	s.run()
	ids := s.publish(n)
	eventually(s.t, "the DLQ to fill", func() bool { return s.depth(s.dlq) == n })
	s.buggy.Store(false)
	for _, id := range ids[:applied] {
		if _, err := s.pool.Exec(context.Background(), `INSERT INTO processed_event (consumer, event_id) VALUES ($1, $2)`, testConsumer, id); err != nil {
			s.t.Fatal(err)
		}
	}
	return ids
}

func TestDLQListAndShow(t *testing.T) {
	t.Parallel()
	s := newShop(t)
	ids := s.poisoned(5, 0)

	r := idem(t, s.schema, "dlq", "list", s.dlq, "--json")
	wantCode(t, r, exitOK)
	list := decode[dlqList](t, r)
	if list.Depth != 5 || list.Listed != 5 {
		t.Fatalf("list: %+v", list)
	}
	got := map[string]bool{}
	for _, m := range list.Messages {
		got[m.EventID] = true
		if m.EventName != "order.placed" || m.Class != "permanent" || !strings.Contains(m.Reason, "unknown product sku-42") || m.Attempts != 1 || m.Origin != s.queue || m.Payload != nil {
			t.Fatalf("message: %+v", m)
		}
	}
	for _, id := range ids {
		if !got[id] {
			t.Fatalf("event %s not listed", id)
		}
	}
	// Listing did not consume.
	if d := s.depth(s.dlq); d != 5 {
		t.Fatalf("DLQ depth after list: %d, want 5", d)
	}
	r = idem(t, s.schema, "dlq", "list", s.dlq)
	wantCode(t, r, exitOK)
	if strings.Contains(r.stdout, "sku-42\"") || !strings.Contains(r.stdout, ids[0]) {
		t.Fatalf("table: %s", r.stdout)
	}

	// show: no payload unless asked; any UUID form.
	r = idem(t, s.schema, "dlq", "show", s.dlq, strings.ToUpper(ids[2]))
	wantCode(t, r, exitOK)
	if strings.Contains(r.stdout, `"order"`) || !strings.Contains(r.stdout, "reason_poisoned") {
		t.Fatalf("show without --payload: %s", r.stdout)
	}
	r = idem(t, s.schema, "dlq", "show", s.dlq, ids[2], "--payload", "--json")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stdout, `"order": 2`) {
		t.Fatalf("show --payload: %s", r.stdout)
	}
	if d := s.depth(s.dlq); d != 5 {
		t.Fatalf("DLQ depth after show: %d, want 5", d)
	}

	// Bad input: one line, nothing changed.
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"dlq", "list", testenv.UniqueName("nope")}, exitNotFound},
		{[]string{"dlq", "show", s.dlq, "not-a-uuid"}, exitUsage},
		{[]string{"dlq", "show", s.dlq, "0190f0e2-1234-7abc-8def-0123456789ab"}, exitNotFound},
		{[]string{"dlq", "redrive", s.dlq}, exitUsage},
		{[]string{"dlq", "redrive", s.dlq, "--all", "--event-id", ids[0]}, exitUsage},
		{[]string{"dlq", "redrive", s.dlq, "--event-id", "0190f0e2-1234-7abc-8def-0123456789ab"}, exitNotFound},
		{[]string{"dlq", "redrive", s.dlq, "--event-id", ids[0], "--event-id", "0190f0e2-1234-7abc-8def-0123456789ab"}, exitNotFound},
		{[]string{"dlq", "redrive", s.dlq, "--all", "--to", testenv.UniqueName("nope")}, exitNotFound},
		{[]string{"dlq", "redrive", testenv.UniqueName("nope"), "--all"}, exitNotFound},
	} {
		r := idem(t, s.schema, c.args...)
		wantCode(t, r, c.code)
		if n := strings.Count(strings.TrimSpace(r.stderr), "\n"); n != 0 || r.stderr == "" {
			t.Fatalf("%v: want a one-line error, got %q", c.args, r.stderr)
		}
	}
	if d, q := s.depth(s.dlq), s.depth(s.queue); d != 5 || q != 0 {
		t.Fatalf("after bad input: DLQ %d (want 5), queue %d (want 0)", d, q)
	}
	if s.calls.Load() != 0 {
		t.Fatalf("handler called %d times", s.calls.Load())
	}

	// Redrive one by id: only that one moves and is applied.
	r = idem(t, s.schema, "dlq", "redrive", s.dlq, "--event-id", ids[1], "--json")
	wantCode(t, r, exitOK)
	if rep := decode[redriveReport](t, r); rep.Redriven != 1 || rep.Items[0].EventID != ids[1] {
		t.Fatalf("redrive: %+v", rep)
	}
	eventually(t, "the redriven event to be applied", func() bool { _, d := s.effects(); return d == 1 })
	if d := s.depth(s.dlq); d != 4 {
		t.Fatalf("DLQ depth: %d, want 4", d)
	}
}

// TestDLQRedrive: 100 poisoned messages, 40 of them already applied (their
// processed rows present), redriven to their queue: 60 applied once, 40
// skipped as duplicates, the DLQ empty.
func TestDLQRedrive(t *testing.T) {
	t.Parallel()
	s := newShop(t)
	s.poisoned(100, 40)

	r := idem(t, s.schema, "dlq", "redrive", s.dlq, "--all", "--dry-run", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[redriveReport](t, r); rep.Redriven != 0 || len(rep.Items) != 100 || rep.Items[0].Result != "would redrive" || rep.Items[0].To != s.queue {
		t.Fatalf("dry run: %+v", rep)
	}
	if d := s.depth(s.dlq); d != 100 {
		t.Fatalf("dry run moved messages: DLQ %d", d)
	}

	r = idem(t, s.schema, "dlq", "redrive", s.dlq, "--all", "--progress", "25")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stderr, "100 moved") || !strings.Contains(r.stdout, "100 redriven") {
		t.Fatalf("progress/summary missing: %s / %s", r.stderr, r.stdout)
	}
	s.wantApplied(t, 60, 40)
}

func (s *shop) wantApplied(t *testing.T, applied, minDuplicates int) {
	t.Helper()
	eventually(t, "60 effects and both queues empty", func() bool {
		_, d := s.effects()
		return d == applied && s.depth(s.queue) == 0 && s.outcomes.Count(inbox.OutcomeDuplicate)+s.outcomes.Count(inbox.OutcomeProcessed) >= applied+minDuplicates
	})
	rows, distinct := s.effects()
	if rows != applied || distinct != applied || int(s.calls.Load()) != applied {
		t.Fatalf("effects %d (distinct %d), handler calls %d; want %d each", rows, distinct, s.calls.Load(), applied)
	}
	if p, d := s.outcomes.Count(inbox.OutcomeProcessed), s.outcomes.Count(inbox.OutcomeDuplicate); p != applied || d < minDuplicates {
		t.Fatalf("outcomes: %d processed (want %d), %d duplicates (want ≥ %d)", p, applied, d, minDuplicates)
	}
	if d := s.depth(s.dlq); d != 0 {
		t.Fatalf("DLQ depth %d, want 0", d)
	}
}

// TestDLQRedriveKilled: the same with the redrive SIGKILLed after its 25th
// confirmed publish (before acking that dead letter), then run again: nothing
// lost, the one copy published twice is skipped by the claim.
func TestDLQRedriveKilled(t *testing.T) {
	t.Parallel()
	s := newShop(t)
	s.poisoned(100, 40)

	args, _ := json.Marshal([]string{"dlq", "redrive", s.dlq, "--all", "--window", "10", "--amqp-url", testenv.AMQPURL(),
		"--database-url", testenv.SchemaURL(s.schema)})
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChildArgs+"="+string(args), envCrashAfter+"=25")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("child: want SIGKILL, got %v\n%s", err, out)
	}
	// 24 dead letters acked; the 25th was published and confirmed but not
	// acked, so it is back in the DLQ (and its copy on the queue).
	eventually(t, "the unacked dead letter to come back", func() bool { return s.depth(s.dlq) == 76 })

	r := idem(t, s.schema, "dlq", "redrive", s.dlq, "--all", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[redriveReport](t, r); rep.Redriven != 76 {
		t.Fatalf("second run: %+v", rep)
	}
	s.wantApplied(t, 60, 41)
}

// TestDLQBrokerDeadLettered: a message RabbitMQ itself dead-lettered (here a
// reject without requeue on a queue with a dead-letter exchange) carries
// x-death: list shows its origin, reason and failure time, and a redrive
// without --to sends it back to that queue without the x-death headers.
func TestDLQBrokerDeadLettered(t *testing.T) {
	t.Parallel()
	conn, ch := amqpChannel(t)
	q, dlq := testenv.UniqueName("idem_bq"), testenv.UniqueName("idem_bdlq")
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(q, false, false, false)
		_, _ = ch.QueueDelete(dlq, false, false, false)
	})
	msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": 7})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := idemamqp.Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now().Add(-time.Second)
	if err := ch.Publish("", q, false, false, pub); err != nil {
		t.Fatal(err)
	}
	var d amqp091.Delivery
	eventually(t, "the message", func() bool {
		var ok bool
		d, ok, err = ch.Get(q, false)
		return err == nil && ok
	})
	if err := d.Reject(false); err != nil {
		t.Fatal(err)
	}
	c := &shop{t: t, conn: conn}
	eventually(t, "the dead letter", func() bool { return c.depth(dlq) == 1 })

	r := idem(t, "public", "dlq", "list", dlq, "--json")
	wantCode(t, r, exitOK)
	m := decode[dlqList](t, r).Messages[0]
	if m.EventID != msg.UUID || m.Origin != q || m.Class != "rejected" || m.FirstFailure == nil || time.Time(*m.FirstFailure).Before(before) {
		t.Fatalf("listed: %+v", m)
	}
	// An unroutable copy (an exchange with no binding) comes back
	// (mandatory): the dead letter stays, exit 4.
	unbound := testenv.UniqueName("idem_unbound")
	if err := ch.ExchangeDeclare(unbound, amqp091.ExchangeTopic, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.ExchangeDelete(unbound, false, false) }()
	r = idem(t, "public", "dlq", "redrive", dlq, "--all", "--exchange", unbound, "--to", "nowhere")
	wantCode(t, r, exitFailed)
	if !strings.Contains(r.stdout, "returned unroutable") {
		t.Fatalf("redrive to an unbound exchange: %s", r.stdout)
	}
	eventually(t, "the dead letter back", func() bool { return c.depth(dlq) == 1 })
	wantCode(t, idem(t, "public", "dlq", "redrive", dlq, "--all"), exitOK)
	eventually(t, "the redriven copy", func() bool { return c.depth(q) == 1 })
	back, ok, err := ch.Get(q, true)
	if err != nil || !ok {
		t.Fatalf("get: %v %v", ok, err)
	}
	if string(back.Body) != string(pub.Body) || back.MessageId != msg.UUID {
		t.Fatalf("copy differs: %q / %s", back.Body, back.MessageId)
	}
	for k := range back.Headers {
		if strings.HasPrefix(k, "x-") {
			t.Fatalf("copy kept broker header %s", k)
		}
	}
	if c.depth(dlq) != 0 {
		t.Fatal("DLQ not empty")
	}
}

// TestDLQOriginUnknown: a dead letter whose topic_poisoned is no queue (a
// routing key of a topic exchange) and that names no origin queue (poisoned
// before idempotency_origin_queue, or by another publisher) has no origin:
// list says so, a redrive without --to leaves it (exit 2, naming --to) and
// moves the one whose origin queue is named; with --to it goes there, without
// the poison headers.
func TestDLQOriginUnknown(t *testing.T) {
	t.Parallel()
	conn, ch := amqpChannel(t)
	q, dlq := testenv.UniqueName("idem_oq"), testenv.UniqueName("idem_odlq")
	for _, name := range []string{q, dlq} {
		if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(q, false, false, false)
		_, _ = ch.QueueDelete(dlq, false, false, false)
	})
	deadLetter := func(origin string) string {
		msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": 7})
		if err != nil {
			t.Fatal(err)
		}
		pub, err := idemamqp.Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		pub.Headers[headerTopic] = "order.placed"
		pub.Headers[headerReason] = "stock: unknown product sku-42"
		if origin != "" {
			pub.Headers[headerOriginQueue] = origin
		}
		if err := ch.Publish("", dlq, false, false, pub); err != nil {
			t.Fatal(err)
		}
		return msg.UUID
	}
	unknown, named := deadLetter(""), deadLetter(q)
	c := &shop{t: t, conn: conn}
	eventually(t, "the dead letters", func() bool { return c.depth(dlq) == 2 })

	r := idem(t, "public", "dlq", "list", dlq, "--json")
	wantCode(t, r, exitOK)
	ms := decode[dlqList](t, r).Messages
	if ms[0].EventID != unknown || ms[0].Origin != "" || ms[0].Topic != "order.placed" || ms[1].EventID != named || ms[1].Origin != q {
		t.Fatalf("listed: %+v", ms)
	}
	r = idem(t, "public", "dlq", "list", dlq)
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stdout, "? (topic order.placed)") {
		t.Fatalf("list: %s", r.stdout)
	}

	r = idem(t, "public", "dlq", "redrive", dlq, "--all")
	wantCode(t, r, exitNotFound)
	if !strings.Contains(r.stdout, `topic_poisoned "order.placed" is no queue`) || !strings.Contains(r.stdout, "--to QUEUE") ||
		strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
		t.Fatalf("redrive without --to: %s / %s", r.stdout, r.stderr)
	}
	eventually(t, "one moved, one left", func() bool { return c.depth(dlq) == 1 && c.depth(q) == 1 })

	wantCode(t, idem(t, "public", "dlq", "redrive", dlq, "--all", "--to", q), exitOK)
	eventually(t, "the second moved", func() bool { return c.depth(dlq) == 0 && c.depth(q) == 2 })
	for _, id := range []string{named, unknown} {
		back, ok, err := ch.Get(q, true)
		if err != nil || !ok {
			t.Fatalf("get: %v %v", ok, err)
		}
		if back.MessageId != id {
			t.Fatalf("copy %s, want %s", back.MessageId, id)
		}
		for _, k := range []string{headerTopic, headerReason, headerOriginQueue} {
			if _, ok := back.Headers[k]; ok {
				t.Fatalf("copy kept poison header %s", k)
			}
		}
	}
}

// TestDLQMalformed: a delivery that is not an envelope reaches the DLQ
// verbatim (the marshaler flags it, the chain poisons it); list shows it as
// malformed with the decoder's reason, show --payload gives the raw body.
func TestDLQMalformed(t *testing.T) {
	t.Parallel()
	s := newShop(t)
	s.run()
	ch, err := s.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", s.queue, false, false, amqp091.Publishing{MessageId: "01a2336f-d6e5-75d2-af83-6a6ca9b072e8", Body: []byte(`{"event_id": "nope"`)}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the dead letter", func() bool { return s.depth(s.dlq) == 1 })
	r := idem(t, s.schema, "dlq", "list", s.dlq, "--json")
	wantCode(t, r, exitOK)
	m := decode[dlqList](t, r).Messages[0]
	if !m.Malformed || m.Reason == "" || m.Origin != s.queue || m.EventName != "" {
		t.Fatalf("listed: %+v", m)
	}
	r = idem(t, s.schema, "dlq", "show", s.dlq, m.EventID, "--payload")
	wantCode(t, r, exitOK)
	if !strings.Contains(r.stdout, `"{\"event_id\": \"nope\""`) {
		t.Fatalf("show: %s", r.stdout)
	}
	if s.calls.Load() != 0 {
		t.Fatal("handler called for a malformed delivery")
	}
}

func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}

// amqpChannel dials the broker and opens a channel; the connection closes
// when the test ends.
func amqpChannel(t *testing.T) (*amqp091.Connection, *amqp091.Channel) {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s unreachable: %v", testenv.AMQPURL(), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	return conn, ch
}
