package newuser_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// insertNote writes the effect with a note telling which handler made it.
func insertNote(msg *message.Message, orderID, note string) error {
	tx, ok := middleware.PgxTxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction in the message context")
	}
	_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (order_id, note) VALUES ($1, $2)`, orderID, note)
	return err
}

// failOnce makes a handler that writes its effect and then fails the first
// time it sees an order (a dependency's 503 after the INSERT), then succeeds.
func failOnce() func(msg *message.Message, orderID string) error {
	var mu sync.Mutex
	seen := map[string]bool{}
	return func(msg *message.Message, orderID string) error {
		if err := insertNote(msg, orderID, ""); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if !seen[orderID] {
			seen[orderID] = true
			return errors.New("inventory service: 503 Service Unavailable")
		}
		return nil
	}
}

// orderOf decodes the README's payload.
func orderOf(msg *message.Message) string {
	var order struct {
		OrderID string `json:"order_id"`
	}
	_ = json.Unmarshal(msg.Payload, &order)
	return order.OrderID
}

func tail(s []string, n int) []string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

var _ = context.Background
var _ = strings.Contains

// processed.Migrate forgotten: the consumer refuses to start, with an
// error that says to run it (the table keeps the replay horizon every
// consumer verifies at start), instead of holding deliveries it can never
// claim. Once the operator runs the migration, each event is applied once.
func TestMigrationsNotRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := runStock(ctx, testenv.AMQPURL(), e.dbURL, e.logs, e.n, wiring{skipMigrate: true})
	if err == nil || !strings.Contains(err.Error(), "processed.Migrate") {
		t.Fatalf("a consumer on a table never migrated started, or its error does not say what to run: %v", err)
	}
	e.start(e.n, wiring{})
	e.order("A", 2)
	testenv.Eventually(t, 60*time.Second, "applied once migrated", func(o *testenv.Observed) bool {
		return o.Int("A", e.reservations("A")) == 1 && o.Int("settled", e.logs.settledDeliveries()) == 2
	})
}

// The handler's own table missing (the README's snippet INSERTs into
// reservation, which nothing in it creates): held with an ERROR saying
// what to fix, never dead-lettered; applied once the table exists.
func TestHandlerTableMissing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.exec(`DROP TABLE reservation`)
	e.start(e.n, wiring{})
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "an ERROR saying what to fix", func(o *testenv.Observed) bool {
		return o.Int("errors", len(e.logs.errors("Configuration error"))) >= 1
	})
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered for a missing table", n)
	}
	e.exec(`CREATE TABLE reservation (order_id text NOT NULL, note text NOT NULL DEFAULT '')`)
	testenv.Eventually(t, 60*time.Second, "applied once the table exists", func(o *testenv.Observed) bool {
		return o.Int("A", e.reservations("A")) == 1 && o.Int("settled", e.logs.settledDeliveries()) == 1
	})
}

// subCfg.Marshaler = idamqp.Marshaler{} forgotten (watermill-amqp's default
// marshaler): no message has a UUID, so every one would be refused. It is a
// configuration error: each delivery is held with an ERROR hint naming the
// envelope marshaler (never dead-lettered, never applied) until the
// consumer runs with the adapter, which then applies the event once.
func TestEnvelopeMarshalerForgotten(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	stop := e.start(e.n, wiring{
		subscriber: func(c *amqp.Config) { c.Marshaler = amqp.DefaultMarshaler{} },
		retry:      func(c *middleware.RetryConfig) { c.MaxHold = 2 * time.Second },
	})
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "held with a hint naming the marshaler", func(o *testenv.Observed) bool {
		return o.Int("hints", len(e.logs.errors("marshaler"))) >= 2
	})
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered for a subscriber's marshaler", n)
	}
	if n := e.reservations("A"); n != 0 {
		t.Fatalf("%d reservations without an event id", n)
	}
	t.Logf("hint: %s", e.logs.errors("marshaler")[0])
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	e.start(e.n, wiring{})
	testenv.Eventually(t, 60*time.Second, "applied once with the adapter", func(o *testenv.Observed) bool {
		return o.Int("A", e.reservations("A")) == 1
	})
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered", n)
	}
}
