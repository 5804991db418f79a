package newuser_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// insertNote writes the effect with a note telling which handler made it.
func insertNote(msg *message.Message, orderID, note string) error {
	tx, ok := inbox.PgxTxFromContext(msg.Context())
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

// Two handlers that each receive their own copy of the event (fan-out: two
// queues bound to the same routing key) given the same Consumer, as a
// newcomer does who copies runStock into runWarehouse and keeps
// Consumer: "stock". README: "two handlers that each receive their own copy
// of an event (fan-out) use two names and each apply it once".
//
// Symptom (proven on RabbitMQ 3.10 + PostgreSQL 15): the second handler's
// copy is acked as a duplicate of the first handler's claim ("Event
// skipped", debug): the warehouse effect is never applied, and nothing at
// ERROR says so. Lost effect, silent.
func TestFanOutWithOneConsumerNameLosesAnEffectSilently(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	warehouseQueue := testenv.UniqueName("nc_warehouse.events")
	e.queues = append(e.queues, warehouseQueue)
	w := wiring{extraHandlers: func(router *message.Router, amqpURL string, _ *inbox.Idempotent, chain message.HandlerMiddleware, logger watermill.LoggerAdapter) error {
		subCfg := amqp.NewDurableTopicConfig(amqpURL, e.n.Exchange, warehouseQueue)
		subCfg.Exchange.Durable = true
		subCfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}
		subCfg.Marshaler = idamqp.Marshaler{}
		sub, err := amqp.NewSubscriber(subCfg, logger)
		if err != nil {
			return err
		}
		router.AddConsumerHandler("notify_warehouse", e.n.Topic, sub, func(msg *message.Message) error {
			return insertNote(msg, orderOf(msg), "warehouse")
		}).AddMiddleware(chain) // the same chain: the same Idempotent, Consumer "stock"
		return nil
	}}
	e.start(e.n, w)
	testenv.Eventually(t, 30*time.Second, "the warehouse handler consumes", func(o *testenv.Observed) bool {
		return o.Int("consumers", e.consumers(warehouseQueue)) >= 1
	})
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "both copies settled", func(o *testenv.Observed) bool {
		return o.Int("settled", e.logs.settledDeliveries()) == 2
	})
	stock := e.count(`SELECT count(*) FROM reservation WHERE note = ''`)
	warehouse := e.count(`SELECT count(*) FROM reservation WHERE note = 'warehouse'`)
	// One name for a fan-out skips one handler's copy as a duplicate (the
	// documented consequence); what must not happen is that it goes unseen.
	if stock+warehouse != 1 && !(stock == 1 && warehouse == 1) {
		t.Fatalf("fan-out with one Consumer name: stock applied %d, warehouse applied %d", stock, warehouse)
	}
	if errs := e.logs.errors("several handlers"); len(errs) == 0 {
		t.Fatalf("fan-out with one Consumer name: stock applied %d, warehouse applied %d, and no ERROR named the shared consumer (ErrSharedConsumer); ERROR lines: %v", stock, warehouse, e.logs.all("ERROR"))
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

// The chain built by hand in the wrong order: the README says "Poison →
// Retry → Recoverer → Idempotent, in that order (first added = outermost)";
// a newcomer who reads it as "last added = outermost" adds them reversed.
// The handler writes its effect, then a dependency fails (a 503 after the
// INSERT).
//
// Symptom (proven on RabbitMQ 3.10 + PostgreSQL 15): the poison layer is
// now inside the attempt's transaction: it dead-letters the message and
// returns nil, so the idempotent middleware COMMITS the failed handler's
// partial effect and the claim. The dead-letter queue holds a message
// whose effect was applied (reason "503"); no ERROR says the chain is
// misordered. "Failure leaves nothing behind" is broken silently.
func TestChainInReverseOrderCommitsAFailedAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := wiring{
		handler: func(msg *message.Message, orderID string) error {
			if err := insertNote(msg, orderID, ""); err != nil {
				return err
			}
			return errors.New("inventory service: 503 Service Unavailable")
		},
		chain: func(_ *message.Router, h *message.Handler, idem *inbox.Idempotent, _ message.HandlerMiddleware, poison message.Publisher, topic string) {
			pq, err := wmw.PoisonQueueWithFilter(poison, topic, inbox.ShouldPoison)
			if err != nil {
				panic(err)
			}
			retry := wmw.Retry{MaxRetries: 2, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}
			h.AddMiddleware(idem.Middleware, wmw.Recoverer, retry.Middleware, pq) // reversed
		},
	}
	e.start(e.n, w)
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "the event settled", func(o *testenv.Observed) bool {
		dlq, _ := e.depth(e.n.DLQ)
		return o.Int("settled", e.logs.settledDeliveries()) >= 1 || o.Int("dlq", dlq) >= 1
	})
	dlq, _ := e.depth(e.n.DLQ)
	n := e.reservations("A")
	if dlq == 0 || n == 0 {
		return // failed and not applied, or applied and not dead-lettered
	}
	if errs := e.logs.errors("chain"); len(errs) > 0 {
		t.Logf("detected: %v", errs)
		return
	}
	t.Fatalf("chain in reverse order: the handler failed, the message is dead-lettered (%d) AND its effect committed (%d reservation(s)); no ERROR about the wiring; ERROR lines: %v", dlq, n, e.logs.all("ERROR"))
}

// Retry placed inside the idempotent middleware (a hand-built chain with
// the middlewares in another order than the README's: PoisonQueue,
// Idempotent, Recoverer, Retry). The handler writes its effect, then a
// dependency fails once.
//
// Symptom (proven on RabbitMQ 3.10 + PostgreSQL 15): Retry re-runs the
// handler in the same attempt's transaction, so the effect is written
// twice and committed: two reservations for one event, and no ERROR about
// the wiring.
func TestRetryInsideIdempotentAppliesTwice(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := wiring{
		handler: failOnce(),
		chain: func(_ *message.Router, h *message.Handler, idem *inbox.Idempotent, _ message.HandlerMiddleware, poison message.Publisher, topic string) {
			pq, err := wmw.PoisonQueueWithFilter(poison, topic, inbox.ShouldPoison)
			if err != nil {
				panic(err)
			}
			retry := wmw.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond, ResetContextOnRetry: true}
			h.AddMiddleware(pq, idem.Middleware, wmw.Recoverer, retry.Middleware)
		},
	}
	e.start(e.n, w)
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "the event settled", func(o *testenv.Observed) bool {
		return o.Int("settled", e.logs.settledDeliveries()) >= 1
	})
	n := e.reservations("A")
	if n == 1 {
		return
	}
	if errs := e.logs.errors("chain"); len(errs) > 0 {
		t.Logf("detected: %v", errs)
		return
	}
	t.Fatalf("Retry inside the idempotent middleware: %d reservations for one event (want 1), and no ERROR about the wiring; ERROR lines: %v", n, e.logs.all("ERROR"))
}

// The chain added at router level and per handler (a newcomer who reads
// "per handler, not router.AddMiddleware" after adding it to the router):
// the idempotent middleware runs twice, nested.
func TestChainAtRouterAndHandlerLevel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := wiring{chain: func(router *message.Router, h *message.Handler, _ *inbox.Idempotent, chain message.HandlerMiddleware, _ message.Publisher, _ string) {
		router.AddMiddleware(chain)
		h.AddMiddleware(chain)
	}}
	e.start(e.n, w)
	e.order("A", 1)
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if e.reservations("A") == 1 && e.logs.settledDeliveries() >= 1 {
			return
		}
		if errs := e.logs.errors("nested"); len(errs) > 0 {
			t.Logf("detected: %v", errs)
			return
		}
		time.Sleep(100 * time.Millisecond) // polling
	}
	t.Fatalf("chain at router and handler level: after 60 s %d reservation(s), no ERROR naming the double wrap; log: %v",
		e.reservations("A"), tail(e.logs.all(""), 20))
}

// A hand-built chain whose Retry lacks ResetContextOnRetry (Watermill issue
// #467): each retry must still get a fresh transaction of its own.
func TestRetryWithoutResetContextOnRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := wiring{
		handler: failOnce(),
		chain: func(_ *message.Router, h *message.Handler, idem *inbox.Idempotent, _ message.HandlerMiddleware, poison message.Publisher, topic string) {
			pq, err := wmw.PoisonQueueWithFilter(poison, topic, inbox.ShouldPoison)
			if err != nil {
				panic(err)
			}
			retry := wmw.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond} // no ResetContextOnRetry
			h.AddMiddleware(pq, retry.Middleware, wmw.Recoverer, idem.Middleware)
		},
	}
	e.start(e.n, w)
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "the event applied", func(o *testenv.Observed) bool {
		return o.Int("A", e.reservations("A")) >= 1 && o.Int("settled", e.logs.settledDeliveries()) >= 1
	})
	if n := e.reservations("A"); n != 1 {
		t.Fatalf("%d reservations, want 1", n)
	}
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) poisoned, want 0", n)
	}
}

func tail(s []string, n int) []string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

var _ = context.Background
var _ = strings.Contains

// store.Migrate forgotten (the README: "Configuration errors (a missing
// table, e.g. the processed table before Migrate …) are held the same way,
// with an ERROR log saying what to fix: they never empty the queue into the
// poison topic"). Then the operator runs the migration: each event is
// applied once.
func TestMigrationsNotRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start(e.n, wiring{skipMigrate: true})
	e.order("A", 2)
	testenv.Eventually(t, 60*time.Second, "an ERROR saying what to fix", func(o *testenv.Observed) bool {
		return o.Int("errors", len(e.logs.errors("processedstore.Migrate"))) >= 1
	})
	if n, _ := e.depth(e.n.DLQ); n != 0 {
		t.Fatalf("%d message(s) dead-lettered for a missing table", n)
	}
	store, err := processedstore.NewStore(processedstore.Config{Horizon: 7 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background(), sqldb.Pgx(e.pool)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 60*time.Second, "applied once migrated", func(o *testenv.Observed) bool {
		return o.Int("A", e.reservations("A")) == 1 && o.Int("settled", e.logs.settledDeliveries()) == 2
	})
	if n := e.reservations("A"); n != 1 {
		t.Fatalf("%d reservations, want 1", n)
	}
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
// marshaler): the README says "a message with no UUID is refused with a
// hint to configure the envelope marshaler". Each event is refused loudly
// (dead-lettered once, never applied, never looping) with that hint.
func TestEnvelopeMarshalerForgotten(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start(e.n, wiring{subscriber: func(c *amqp.Config) { c.Marshaler = amqp.DefaultMarshaler{} }})
	e.order("A", 1)
	testenv.Eventually(t, 60*time.Second, "refused with a hint naming the marshaler", func(o *testenv.Observed) bool {
		return o.Int("hints", len(e.logs.errors("marshaler"))) >= 1
	})
	testenv.Eventually(t, 60*time.Second, "dead-lettered once", func(o *testenv.Observed) bool {
		dlq, _ := e.depth(e.n.DLQ)
		return o.Int("dlq", dlq) == 1
	})
	if n := e.reservations("A"); n != 0 {
		t.Fatalf("%d reservations without an event id", n)
	}
	t.Logf("hint: %s", e.logs.errors("marshaler")[0])
}
