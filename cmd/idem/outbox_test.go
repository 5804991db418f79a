package main

import (
	"context"
	"strings"
	"testing"
	"time"
	_ "time/tzdata" // zones for the offsets test, whatever the machine has

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// TestOutboxReplay: the relayed events written in a time range (and of a
// topic) are published again to the events exchange with their original
// event ids, through the outbox library's Replay; a dry run publishes
// nothing; bad input changes nothing.
func TestOutboxReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Four events written one after the other; the range [from, to) is cut
	// between their write times (the outbox stamps them in microseconds).
	topics := []string{"order.placed", "order.placed", "order.cancelled", "order.placed"}
	ids := make([]string, len(topics))
	var cuts []time.Time
	for i, topic := range topics {
		if i == 1 || i == 3 {
			cuts = append(cuts, nextMicro())
		}
		msg, err := marshaler.NewMessage(topic, map[string]int{"order": i})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = msg.UUID
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := ob.PgxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish(topic, msg); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		nextMicro()
	}
	// The relay sends them (to nowhere) and keeps them in its archive.
	sink := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	relay, err := ob.NewRelay(sink, outbox.RelayConfig{Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(rctx) }()
	eventually(t, "the relay to send the 4 rows", func() bool {
		n, err := ob.Pending(ctx)
		return err == nil && n == 0
	})
	stop()
	<-done

	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	exchange, queue := testenv.UniqueName("idem_events"), testenv.UniqueName("idem_replayed")
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, "#", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_ = ch.ExchangeDelete(exchange, false, false)
	})
	from, to := cuts[0].Format(time.RFC3339Nano), cuts[1].Format(time.RFC3339Nano)
	sh := &shop{t: t, conn: conn}

	r := idem(t, schema, "outbox", "replay", "--from", from, "--to", to, "--dry-run", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[replayReport](t, r); rep.Published != 2 || !rep.DryRun {
		t.Fatalf("dry run: %+v", rep)
	}
	// The same instants written with other offsets (the operator's zone,
	// whatever the process TZ) select the same rows: write times are UTC
	// instants of the database clock.
	for _, zone := range []string{"Pacific/Chatham", "America/St_Johns"} {
		loc, err := time.LoadLocation(zone)
		if err != nil {
			t.Fatal(err)
		}
		f, tt := cuts[0].In(loc).Format(time.RFC3339Nano), cuts[1].In(loc).Format(time.RFC3339Nano)
		r := idem(t, schema, "outbox", "replay", "--from", f, "--to", tt, "--dry-run", "--json")
		wantCode(t, r, exitOK)
		if rep := decode[replayReport](t, r); rep.Published != 2 {
			t.Fatalf("dry run with offsets of %s (%s, %s): %+v", zone, f, tt, rep)
		}
	}
	for _, args := range [][]string{
		{"--from", to, "--to", from},        // empty range
		{"--from", "yesterday", "--to", to}, // malformed
		{"--to", to},                        // no --from
	} {
		wantCode(t, idem(t, schema, append([]string{"outbox", "replay", "--exchange", exchange}, args...)...), exitUsage)
	}
	wantCode(t, idem(t, schema, "outbox", "replay", "--from", from, "--to", to, "--exchange", testenv.UniqueName("nope")), exitNotFound)
	if n := sh.depth(queue); n != 0 {
		t.Fatalf("published %d on bad input or dry run", n)
	}

	r = idem(t, schema, "outbox", "replay", "--from", from, "--to", to, "--topic", "order.placed", "--exchange", exchange)
	wantCode(t, r, exitOK)
	r = idem(t, schema, "outbox", "replay", "--from", from, "--to", to, "--exchange", exchange, "--json")
	wantCode(t, r, exitOK)
	eventually(t, "3 replayed copies", func() bool { return sh.depth(queue) == 3 })
	got := map[string]int{}
	for i := 0; i < 3; i++ {
		d, ok, err := ch.Get(queue, true)
		if err != nil || !ok {
			t.Fatalf("get: %v %v", ok, err)
		}
		env, err := marshaler.Decode(d.Body, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if env.EventID.String() != d.MessageId {
			t.Fatalf("message id %s, event id %s", d.MessageId, env.EventID)
		}
		got[d.RoutingKey+" "+env.EventID.String()]++
	}
	want := map[string]int{"order.placed " + ids[1]: 2, "order.cancelled " + ids[2]: 1}
	if len(got) != len(want) || got["order.placed "+ids[1]] != 2 || got["order.cancelled "+ids[2]] != 1 {
		t.Fatalf("replayed %v, want %v", got, want)
	}
}

// nextMicro waits until the wall clock moves to the next microsecond and
// returns it (write times are microseconds).
func nextMicro() time.Time {
	start := time.Now().UnixMicro()
	for {
		if now := time.Now(); now.UnixMicro() > start {
			return now
		}
	}
}

// TestOutboxRedrive: dead-lettered outbox rows go back to pending with
// "outbox redrive", by event id or topic (a dry run counts and moves
// nothing), attempts reset; an empty selection is a usage error.
func TestOutboxRedrive(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	topics := []string{"order.placed", "order.placed", "order.cancelled"}
	ids := make([]string, len(topics))
	for i, topic := range topics {
		msg, err := marshaler.NewMessage(topic, map[string]int{"order": i})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = msg.UUID
		// Written straight into the dead-letter table, as the relay does
		// after MaxAttempts.
		if _, err := pool.Exec(ctx, `INSERT INTO outbox_dead (id, event_id, topic, payload, metadata, created_at_us, attempts, reason, dead_at_us)
			VALUES ($1, $2, $3, $4, '{}', 1, 10, 'refused', 2)`, i+1, msg.UUID, topic, []byte(msg.Payload)); err != nil {
			t.Fatal(err)
		}
	}
	count := func(table string) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	wantCode(t, idem(t, schema, "outbox", "redrive"), exitUsage)
	wantCode(t, idem(t, schema, "outbox", "redrive", "--all", "--topic", "x"), exitUsage)
	r := idem(t, schema, "outbox", "redrive", "--topic", "order.placed", "--dry-run", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[outboxRedriveReport](t, r); rep.Moved != 2 || !rep.DryRun {
		t.Fatalf("dry run: %+v", rep)
	}
	if count("outbox_dead") != 3 || count("outbox") != 0 {
		t.Fatal("a dry run moved rows")
	}
	r = idem(t, schema, "outbox", "redrive", "--event-id", ids[2], "--json")
	wantCode(t, r, exitOK)
	if rep := decode[outboxRedriveReport](t, r); rep.Moved != 1 {
		t.Fatalf("by event id: %+v", rep)
	}
	var id string
	var attempts int
	if err := pool.QueryRow(ctx, `SELECT event_id, attempts FROM outbox`).Scan(&id, &attempts); err != nil {
		t.Fatal(err)
	}
	if id != ids[2] || attempts != 0 {
		t.Fatalf("pending row %s with %d attempts, want %s with 0", id, attempts, ids[2])
	}
	// A typo beside a valid id changes nothing and says which is missing
	// (as dlq redrive does); an id in another UUID text form is found.
	missing := "0190f3a2-0000-7000-8000-000000000000"
	r = idem(t, schema, "outbox", "redrive", "--event-id", ids[0], "--event-id", missing)
	wantCode(t, r, exitNotFound)
	if !strings.Contains(r.stderr, missing) {
		t.Fatalf("the missing id is not named: %q", r.stderr)
	}
	if count("outbox_dead") != 2 || count("outbox") != 1 {
		t.Fatal("a redrive with a missing id moved rows")
	}
	wantCode(t, idem(t, schema, "outbox", "redrive", "--event-id", "not-a-uuid"), exitUsage)
	r = idem(t, schema, "outbox", "redrive", "--event-id", "{"+strings.ToUpper(ids[0])+"}", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[outboxRedriveReport](t, r); rep.Moved != 1 {
		t.Fatalf("by an upper-case, braced event id: %+v", rep)
	}
	wantCode(t, idem(t, schema, "outbox", "redrive", "--all"), exitOK)
	if count("outbox_dead") != 0 || count("outbox") != 3 {
		t.Fatal("--all moved every row")
	}
}
