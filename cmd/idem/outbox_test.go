package main

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// TestOutboxReplay: the events of a time range (and topic) are published
// again to the events exchange with their original event ids; a dry run
// publishes nothing; bad input changes nothing.
func TestOutboxReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	ob, err := outbox.New(outbox.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(ctx, wsql.BeginnerFromPgx(pool)); err != nil {
		t.Fatal(err)
	}
	base := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	type ev struct {
		topic string
		at    time.Time
	}
	evs := []ev{
		{"order.placed", base.Add(-time.Minute)},       // before the range
		{"order.placed", base.Add(time.Minute)},        // in
		{"order.cancelled", base.Add(2 * time.Minute)}, // in, other topic
		{"order.placed", base.Add(5 * time.Minute)},    // at To: out
	}
	ids := make([]string, len(evs))
	for i, e := range evs {
		msg, err := marshaler.NewMessageWithID(uuid.Must(uuid.NewV7()), e.topic, e.at, map[string]int{"order": i})
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
		if err := pub.Publish(e.topic, msg); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}

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
	from, to := base.Format(time.RFC3339), base.Add(5*time.Minute).Format(time.RFC3339)
	sh := &shop{t: t, conn: conn}

	r := idem(t, schema, "outbox", "replay", "--from", from, "--to", to, "--dry-run", "--json")
	wantCode(t, r, exitOK)
	if rep := decode[replayReport](t, r); rep.Published != 2 || !rep.DryRun {
		t.Fatalf("dry run: %+v", rep)
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
