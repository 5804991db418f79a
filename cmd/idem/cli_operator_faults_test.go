package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/outbox"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// TestPurgeDryRunCountsWhatThePurgerDeletes: docs/operations.md, "The preview
// is exact. purge --dry-run counts exactly what the purger then deletes."
// Rows dated just past the horizon (within the purger's claim slack) are
// kept by the purger: the preview must not count them.
func TestPurgeDryRunCountsWhatThePurgerDeletes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, q, schema := schemaDB(t)
	store, err := processedstore.NewStore(processedstore.Config{Horizon: 48 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	// 2 rows 3 days old, 3 rows 48h + 2 minutes old, 1 new.
	for i, age := range []string{"3 days", "3 days", "48 hours 2 minutes", "48 hours 2 minutes", "48 hours 2 minutes", "0"} {
		if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, processed_at, event_at)
			VALUES ('stock', gen_random_uuid(), now() - $1::interval, now() - $1::interval)`, age); err != nil {
			t.Fatal(i, err)
		}
	}
	r := idem(t, schema, "purge", "--dry-run", "--horizon", "48h", "--json")
	wantCode(t, r, exitOK)
	p := decode[purgePreview](t, r)
	purger, err := processedstore.NewPurger(store, sqldb.StdPool(db), processedstore.PurgerConfig{Horizon: 48 * time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	n, ran, err := purger.PurgeNow(ctx)
	if err != nil || !ran {
		t.Fatalf("purge: %d %v %v", n, ran, err)
	}
	if p.ToDelete != n {
		t.Fatalf("purge --dry-run --horizon 48h announced %d row(s) to delete; the purger with Horizon 48h then deleted %d", p.ToDelete, n)
	}
}

// TestDLQRedriveToUnknownExchangeIsNotFoundAndMovesNothing: operations.md,
// exit "2 not found (… unknown queue, exchange, message or key)" and "A typo
// changes nothing … stops the command before anything moves". --exchange
// with a typo: the command must say the exchange does not exist (exit 2),
// and every dead letter stays.
func TestDLQRedriveToUnknownExchangeIsNotFoundAndMovesNothing(t *testing.T) {
	t.Parallel()
	conn, ch := amqpChannel(t)
	dlq := testenv.UniqueName("idem_h9dlq")
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(dlq, false, false, false) })
	var ids []string
	for i := 0; i < 3; i++ {
		msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": i})
		if err != nil {
			t.Fatal(err)
		}
		body, _, err := marshaler.EncodeMessage(msg, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, msg.UUID)
		if err := ch.Publish("", dlq, false, false, amqp091.Publishing{MessageId: msg.UUID, DeliveryMode: amqp091.Persistent, Body: body,
			Headers: amqp091.Table{"idempotency_origin_queue": "orders", "reason_poisoned": "bug"}}); err != nil {
			t.Fatal(err)
		}
	}
	c := &shop{t: t, conn: conn}
	eventually(t, "the dead letters", func() bool { return c.depth(dlq) == 3 })
	// The command runs as a child process (TestMain), given 60 s: on the
	// current code it never returns (drainReturns spins on the return
	// channel amqp091 closed with the channel) and SIGINT cannot stop it.
	args, _ := json.Marshal([]string{"dlq", "redrive", dlq, "--all", "--exchange", testenv.UniqueName("idem_of_no_such_exchange"), "--to", "order.placed",
		"--amqp-url", testenv.AMQPURL()})
	cctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(cctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChildArgs+"="+string(args))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	eventually(t, "the dead letters back", func() bool { return c.depth(dlq) == 3 })
	if cctx.Err() != nil {
		t.Fatalf("idem dlq redrive --exchange <missing> --to KEY still running after 60 s (killed): it hangs\nstdout: %s\nstderr: %s", stdout.String(), stderr.String())
	}
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	}
	if code != exitNotFound || !strings.Contains(stderr.String(), "does not exist") {
		t.Fatalf("redrive to a missing exchange: exit %d, want %d (not found) with \"exchange … does not exist\"\nstdout: %s\nstderr: %s", code, exitNotFound, stdout.String(), stderr.String())
	}
}

// TestOutboxReplayUnroutableIsNotCountedRepublished: operations.md,
// "Replays are exact. outbox replay republishes exactly the archived rows
// of the range". An exchange with no queue bound for the rows' topic: the
// broker drops each copy, yet the command reports them republished, exit 0
// (watermill-amqp's Publisher, not mandatory; the library's own
// ConfirmedPublisher returns ErrUnroutable for exactly this).
func TestOutboxReplayUnroutableIsNotCountedRepublished(t *testing.T) {
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
	from := nextMicro()
	for i := 0; i < 2; i++ {
		msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": i})
		if err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pub, err := ob.PgxPublisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := pub.Publish("order.placed", msg); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	to := nextMicro().Add(time.Second)
	sink := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	relay, err := ob.NewRelay(sink, outbox.RelayConfig{Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(rctx) }()
	eventually(t, "the relay to send the rows", func() bool {
		n, err := ob.Pending(ctx)
		return err == nil && n == 0
	})
	stop()
	<-done

	_, ch := amqpChannel(t)
	exchange := testenv.UniqueName("idem_of_events")
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(exchange, false, false) })
	// No queue bound: every copy is unroutable.
	r := idem(t, schema, "outbox", "replay", "--from", from.Format(time.RFC3339Nano), "--to", to.Format(time.RFC3339Nano), "--exchange", exchange, "--json")
	if r.code == exitOK {
		rep := decode[replayReport](t, r)
		t.Fatalf("replay to an exchange routing the topic nowhere: exit 0, %d event(s) reported republished; the broker dropped every copy (no queue holds one)", rep.Published)
	}
}

// TestOutboxRedriveFindsAnIDStoredInAnotherUUIDForm: operations.md, "With
// --event-id, every id must be dead-lettered (any UUID text form)". The
// outbox accepts a message whose UUID is any form ParseEventID takes (here
// upper case, as a .NET producer writes it) and stores it verbatim; the
// command canonicalises the flag and compares text: the dead row is
// "not dead-lettered", even when the operator pastes the stored id.
func TestOutboxRedriveFindsAnIDStoredInAnotherUUIDForm(t *testing.T) {
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
	msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": 1})
	if err != nil {
		t.Fatal(err)
	}
	msg.UUID = strings.ToUpper(msg.UUID)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ob.PgxPublisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("order.placed", msg); err != nil {
		_ = tx.Rollback(ctx)
		t.Fatalf("the outbox refused an upper-case event id: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Dead-lettered as the relay does after MaxAttempts.
	if _, err := pool.Exec(ctx, `WITH d AS (DELETE FROM outbox RETURNING *)
		INSERT INTO outbox_dead (id, event_id, topic, payload, metadata, created_at_us, attempts, reason, dead_at_us)
		SELECT id, event_id, topic, payload, metadata, created_at_us, 10, 'refused', 2 FROM d`); err != nil {
		t.Fatal(err)
	}
	var stored string
	if err := pool.QueryRow(ctx, `SELECT event_id FROM outbox_dead`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	r := idem(t, schema, "outbox", "redrive", "--event-id", stored, "--json")
	if r.code != exitOK {
		t.Fatalf("outbox redrive --event-id %s (the id as stored in outbox_dead): exit %d, want 0\nstderr: %s", stored, r.code, r.stderr)
	}
}
