// Package crashlooptest is the crash-loop scenario of issue 24, run on a
// real transport by that transport's tests: a consumer process whose
// handler SIGKILLs itself on one poisoned event is started again and again
// (the test binary re-executed as a child), until the poisoned event is
// dead-lettered, with a reason naming the crash loop, and the events
// published before and after it are each applied once.
//
// A transport's test calls [Child] from its test binary's init (so no
// TestMain is needed) and [Run] from a test. Setting CRASHLOOP_MAX_CRASHES
// in the test's environment passes that ConsumerConfig.MaxCrashes to the
// children: -1 (no bound) shows the test failing.
package crashlooptest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

const (
	childEnv     = "CRASHLOOP_CHILD"
	schemaEnv    = "CRASHLOOP_SCHEMA"
	poisonEnv    = "CRASHLOOP_POISON"
	maxCrashEnv  = "CRASHLOOP_MAX_CRASHES"
	familyEnv    = "CRASHLOOP_FAMILY"
	consumerName = "crashloop"
)

// Wiring is what a child consumes from and dead-letters to.
type Wiring struct {
	Subscriber  message.Subscriber
	Topic       string
	Poison      message.Publisher
	PoisonTopic string
}

// Child runs the child consumer and exits, when the test binary was started
// as one by Run; otherwise it returns at once. build makes the transport's
// subscriber and dead-letter publisher from the environment Run passed
// (Transport.Env).
func Child(build func(logger watermill.LoggerAdapter) (Wiring, error)) {
	if os.Getenv(childEnv) == "" {
		return
	}
	if err := runChild(build); err != nil {
		fmt.Fprintln(os.Stderr, "crashloop child:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

func runChild(build func(logger watermill.LoggerAdapter) (Wiring, error)) error {
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(schemaEnv)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	w, err := build(logger)
	if err != nil {
		return err
	}
	maxCrashes := 0
	if s := os.Getenv(maxCrashEnv); s != "" {
		if maxCrashes, err = strconv.Atoi(s); err != nil {
			return fmt.Errorf("%s: %w", maxCrashEnv, err)
		}
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: consumerName, DB: idempotency.Pgx(pool), MaxCrashes: maxCrashes,
		Poison: middleware.PoisonConfig{Publisher: w.Poison, Topic: w.PoisonTopic},
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	poison := os.Getenv(poisonEnv)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == poison {
			fmt.Fprintln(os.Stderr, "crashloop child: poisoned event, SIGKILL")
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	}
	if os.Getenv(familyEnv) != "" {
		// The handler behind the latest-per-family filter (RunFamily).
		families, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
		if err != nil {
			return err
		}
		filter, err := versioned.NewLatestFilter(versioned.LatestFilterConfig{Families: families, Latest: families}, logger)
		if err != nil {
			return err
		}
		handler = filter.Middleware(handler)
	}
	if _, err := c.AddConsumerHandler(router, "crashloop", w.Topic, w.Subscriber, func(msg *message.Message) error {
		_, err := handler(msg)
		return err
	}); err != nil {
		return err
	}
	// SIGTERM (runChildren, once its condition holds) closes the router:
	// the delivery in flight is finished, its ack (after a dead-letter
	// publish) included, instead of being redelivered to the next child.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	return router.Run(ctx)
}

// Transport is one transport's side of the scenario, in the parent.
type Transport struct {
	// Marked: the transport marks redeliveries (AMQP, JetStream, Redis
	// Streams with the counting client), so the poisoned event's first
	// crash is not counted and it is dead-lettered at its MaxCrashes+2nd
	// delivery; unmarked (Kafka), every child's first attempts are counted
	// and it is dead-lettered at its MaxCrashes+1st.
	Marked bool
	// Env is passed to every child (names of the transport's topics).
	Env []string
	// Publish publishes msgs, in order, to the topic the children consume.
	Publish func(t testing.TB, msgs []*message.Message)
	// DeadLetters returns the messages received on the dead-letter topic
	// since the last call.
	DeadLetters func(t testing.TB) []*message.Message
	// NewPerChild, when above 0, is a steady producer (Run only): that
	// many new events are published before each child starts, so a
	// restarted consumer that reads new events before it is given the
	// poisoned one back (Redis Streams claims pending entries after
	// MaxIdleTime) handles them first. Each must be applied once too.
	NewPerChild int
}

// Run publishes three events, the poisoned one and three more, then starts
// child consumers one after the other: each dies by SIGKILL on the poisoned
// event until it is dead-lettered; then the last child applies the rest and
// is stopped. It checks that the poisoned event was dead-lettered exactly
// once, with a reason naming the crash loop, after at most the deliveries
// the bound allows, and that each other event was applied exactly once.
func Run(t *testing.T, tr Transport) {
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	if err := processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var msgs []*message.Message
	var others []string
	for i := 0; i < 7; i++ {
		m, err := marshaler.NewMessage("order.placed", map[string]int{"n": i})
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
		if i != 3 {
			others = append(others, m.UUID)
		}
	}
	poison := msgs[3].UUID
	tr.Publish(t, msgs)

	maxCrashes := middleware.DefaultMaxCrashes
	if s := os.Getenv(maxCrashEnv); s != "" {
		maxCrashes, _ = strconv.Atoi(s)
	}
	allowed := maxCrashes // crashes before the dead-lettering delivery
	if maxCrashes < 0 {   // no bound: give it the default's chances
		allowed = middleware.DefaultMaxCrashes
	}
	if tr.Marked {
		allowed++
	}
	var dead []*message.Message
	var applied int
	done := func() bool {
		dead = append(dead, tr.DeadLetters(t)...)
		if err := pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM effect`).Scan(&applied); err != nil {
			t.Fatal(err)
		}
		return len(dead) > 0 && applied == len(others)
	}
	before := func() {
		if tr.NewPerChild <= 0 {
			return
		}
		batch := make([]*message.Message, tr.NewPerChild)
		for i := range batch {
			m, err := marshaler.NewMessage("order.placed", map[string]int{"n": len(others) + i})
			if err != nil {
				t.Fatal(err)
			}
			batch[i] = m
		}
		tr.Publish(t, batch)
		for _, m := range batch {
			others = append(others, m.UUID)
		}
	}
	crashes := runChildren(t, tr, schema, poison, nil, allowed, maxCrashes, before, done,
		func() string {
			return fmt.Sprintf("%d dead letters, %d of %d events applied", len(dead), applied, len(others))
		})
	if crashes < 1 || crashes > allowed {
		t.Fatalf("the poisoned event killed %d consumers; want 1 to %d (MaxCrashes %d)", crashes, allowed, maxCrashes)
	}
	dead = append(dead, tr.DeadLetters(t)...)
	if len(dead) != 1 || dead[0].UUID != poison {
		ids := make([]string, len(dead))
		for i, d := range dead {
			ids[i] = d.UUID
		}
		t.Fatalf("dead letters %v, want exactly the poisoned event %s", ids, poison)
	}
	if r := dead[0].Metadata.Get("reason_poisoned"); !strings.Contains(r, "crash loop") {
		t.Fatalf("dead letter reason %q does not name the crash loop", r)
	}
	for _, id := range others {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Fatalf("event %s applied %d times, want once", id, n)
		}
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_crash`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Fatalf("%d crash counts left behind", left)
	}
	t.Logf("dead-lettered after %d crashes (MaxCrashes %d)", crashes, maxCrashes)
}

// runChildren starts child consumers one after the other, each with env
// added (and before, when not nil, run before each start), until done reports true (polled every 100 ms; the running child is
// then stopped with SIGTERM, finishing its delivery in flight); each child must end by its own SIGKILL on the poisoned
// event, at most allowed+1 times. It returns how many did. state describes
// the progress for a failure.
func runChildren(t *testing.T, tr Transport, schema, poison string, env []string, allowed, maxCrashes int, before func(), done func() bool, state func() string) int {
	t.Helper()
	crashes := 0
	for {
		if crashes > allowed+1 {
			t.Fatalf("the poisoned event killed %d consumers and was not dead-lettered (MaxCrashes %d)", crashes, maxCrashes)
		}
		if before != nil {
			before()
		}
		var out strings.Builder
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(append(append(os.Environ(), childEnv+"=1", schemaEnv+"="+schema, poisonEnv+"="+poison), tr.Env...), env...)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		deadline := time.Now().Add(2 * time.Minute) // a hang guard, not a measurement
	poll:
		for {
			select {
			case <-exited:
				ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
				if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
					t.Fatalf("child %d ended with %s, not by its SIGKILL; output:\n%s", crashes+1, cmd.ProcessState, out.String())
				}
				crashes++
				break poll
			case <-time.After(100 * time.Millisecond):
				switch {
				case done():
					// Stopped, not killed: a child killed between its
					// dead-letter publish and the ack would leave the
					// message to the next one (at least once).
					_ = cmd.Process.Signal(syscall.SIGTERM)
					select {
					case <-exited:
					case <-time.After(time.Minute): // a hang guard, not a measurement
						_ = cmd.Process.Kill()
						<-exited
					}
					return crashes
				case time.Now().After(deadline):
					_ = cmd.Process.Kill()
					<-exited
					t.Fatalf("child %d neither crashed nor finished within 2 min (%s); output:\n%s", crashes+1, state(), out.String())
				}
			}
		}
	}
}

// RunFamily is the crash loop of a family's newest message behind the
// latest-per-family filter (versioned.LatestFilter, the SQL family store):
// the newest message (sequence 3) of a family, recorded as the family's
// latest by the producer (versioned.LatestPublisher), kills every consumer
// that handles it until it is dead-lettered as a crash loop. An older
// message of the family (sequence 2) that arrives afterwards is applied
// once: the filter retired the newest in its last attempt before the crash
// loop, so the family is not frozen behind a message that will never be
// applied. Without that retirement the older message was dropped as
// obsolete, and every later one of the family with it.
func RunFamily(t *testing.T, tr Transport) {
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	db := idempotency.Pgx(pool)
	if err := processed.Migrate(ctx, db, processed.Config{}); err != nil {
		t.Fatal(err)
	}
	families, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := families.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	fam := versioned.Family{Kind: "crashloop.item", ID: "i-1"}
	newMsg := func(seq int64) *message.Message {
		m, err := marshaler.NewMessage("item.changed", map[string]int64{"seq": seq})
		if err != nil {
			t.Fatal(err)
		}
		if err := versioned.SetFamilySeq(m, fam, seq); err != nil {
			t.Fatal(err)
		}
		return m
	}
	pub, err := versioned.NewLatestPublisher(publishFunc(func(msgs []*message.Message) { tr.Publish(t, msgs) }),
		versioned.LatestPublisherConfig{Store: families, Tx: idempotency.PgxTx(pool)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	newest, older := newMsg(3), newMsg(2)
	if err := pub.Publish("item.changed", newest); err != nil {
		t.Fatal(err)
	}

	maxCrashes := middleware.DefaultMaxCrashes
	if s := os.Getenv(maxCrashEnv); s != "" {
		maxCrashes, _ = strconv.Atoi(s)
	}
	allowed := maxCrashes
	if tr.Marked {
		allowed++
	}
	env := []string{familyEnv + "=1"}
	var dead []*message.Message
	crashes := runChildren(t, tr, schema, newest.UUID, env, allowed, maxCrashes, nil, func() bool {
		dead = append(dead, tr.DeadLetters(t)...)
		return len(dead) > 0
	}, func() string { return fmt.Sprintf("%d dead letters", len(dead)) })
	if len(dead) != 1 || dead[0].UUID != newest.UUID || !strings.Contains(dead[0].Metadata.Get("reason_poisoned"), "crash loop") {
		t.Fatalf("dead letters %d (first %s), want the newest message %s as a crash loop", len(dead), dead[0].UUID, newest.UUID)
	}

	// The older message arrives late (published later; the latest record
	// stays on the newest, which never moves back).
	if err := pub.Publish("item.changed", older); err != nil {
		t.Fatal(err)
	}
	var claimed int
	runChildren(t, tr, schema, newest.UUID, env, 0, maxCrashes, nil, func() bool {
		// In the table or, where processed migration 8 made it, in its
		// UUIDv7 claim table.
		q := `SELECT count(*) FROM processed_event WHERE event_id = $1`
		var v7 bool
		if err := pool.QueryRow(ctx, `SELECT to_regclass('processed_event_v7') IS NOT NULL`).Scan(&v7); err != nil {
			t.Fatal(err)
		}
		if v7 {
			q = `SELECT (` + q + `) + (SELECT count(*) FROM processed_event_v7 WHERE event_id = $1)`
		}
		if err := pool.QueryRow(ctx, q, older.UUID).Scan(&claimed); err != nil {
			t.Fatal(err)
		}
		return claimed > 0
	}, func() string { return "the older message not processed yet" })
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, older.UUID).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if applied != 1 {
		t.Fatalf("the older message of the family was applied %d times after its newest was dead-lettered as a crash loop: "+
			"the family is frozen behind it", applied)
	}
	var retired int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM family_applied_retired WHERE consumer = $1 AND family_id = $2`, consumerName, fam.ID).Scan(&retired); err != nil {
		t.Fatal(err)
	}
	if retired != 1 {
		t.Fatalf("%d retirements of the family recorded, want 1", retired)
	}
	t.Logf("newest dead-lettered after %d crashes (MaxCrashes %d); the older one applied after it", crashes, maxCrashes)
}

// publishFunc is a message.Publisher that hands the messages to a function.
type publishFunc func(msgs []*message.Message)

func (f publishFunc) Publish(_ string, msgs ...*message.Message) error {
	f(msgs)
	return nil
}

func (publishFunc) Close() error { return nil }
