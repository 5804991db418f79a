package newuser_test

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// The README's service as written, on the real RabbitMQ and PostgreSQL:
// duplicates (the same event published three times), then poison messages
// (not JSON, an envelope without event_id, a 2 MiB body over the marshaler's
// 1 MiB limit), then a good event after them. Each order is reserved once,
// each poison message reaches the dead-letter queue once, nothing is left
// on the consumer's queue and the event after the poison ones is processed.
func TestREADMEServiceDuplicatesAndPoison(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	stop := e.start(e.n, wiring{})
	e.order("A", 3)
	e.order("B", 1)
	e.raw([]byte("not json"))
	e.raw([]byte(`{"event_name":"order.order.placed.v1","occurred_at":"2026-12-01T00:00:00Z","payload":{"order_id":"X"}}`))
	big := append([]byte(`{"event_id":"01a2338f-1c70-7060-9d54-d358f14a297c","event_name":"order.order.placed.v1","occurred_at":"2026-12-01T00:00:00Z","payload":{"order_id":"Y","pad":"`),
		bytes.Repeat([]byte("x"), 2<<20)...)
	big = append(big, []byte(`"}}`)...)
	e.raw(big)
	e.order("C", 2)
	testenv.Eventually(t, 60*time.Second, "every order reserved, every poison message dead-lettered", func(o *testenv.Observed) bool {
		dlq, _ := e.depth(e.n.DLQ)
		return o.Int("A", e.reservations("A")) == 1 && o.Int("B", e.reservations("B")) == 1 &&
			o.Int("C", e.reservations("C")) == 1 && o.Int("dlq", dlq) == 3 && o.Int("settled deliveries", e.logs.settledDeliveries()) == 9
	})
	if err := stop(); err != nil {
		t.Fatalf("service: %v", err)
	}
	if n, _ := e.depth(e.n.Queue); n != 0 {
		t.Fatalf("%d message(s) left on %s after the service stopped (not acked)", n, e.n.Queue)
	}
	if n, _ := e.depth(e.n.DLQ); n != 3 {
		t.Fatalf("dead-letter queue holds %d messages, want 3 (once each)", n)
	}
	if n := e.count(`SELECT count(*) FROM reservation`); n != 3 {
		t.Fatalf("%d reservations, want 3", n)
	}
	if n := e.count(`SELECT count(*) FROM reservation WHERE order_id IN ('X','Y')`); n != 0 {
		t.Fatalf("a poison message was applied: %d", n)
	}
}

// A poison message whose headers are close to RabbitMQ's frame_max (128
// KiB: all headers travel in one content-header frame). The broker took it
// from its producer; the poison copy carries the same headers plus the
// ones the chain and the marshaler add (reason, topic, handler, malformed
// reason, attempt, …). README: "The poison path cannot fail for its own
// reasons … a huge error text never exceeds the broker's frame".
//
// Symptom (proven on RabbitMQ 3.10, frame_max 131072, + PostgreSQL 15):
// with 130,900 bytes of incoming headers the original is delivered, but
// the poison copy's header frame exceeds frame_max: the broker closes the
// poison publisher's channel ("message not confirmed by the broker:
// channel closed"), the chain retries the publish for MaxHold, nacks, the
// broker redelivers, and so on forever (every MaxHold, 25 min by default):
// the poison message loops, never reaches the dead-letter queue, and while
// it is held its subscription receives nothing else. Each redelivery is
// logged under a new random transport_message_id (the delivery has no
// MessageId), so the logs do not even show it is the same message.
// At fault: middleware/chain.go holdPoison.poison copies every incoming
// metadata key into the poison copy and bounds only the keys it adds;
// marshaler/amqp Marshal (malformed path) sends them all as headers.
func TestPoisonMessageWithHeadersNearFrameMax(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	stop := e.start(e.n, wiring{retry: func(c *middleware.RetryConfig) { c.MaxHold = 5 * time.Second }})
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	pad := 130900
	if v := os.Getenv("NEWUSER_PAD"); v != "" {
		pad, _ = strconv.Atoi(v)
	}
	if err := ch.Publish(e.n.Exchange, e.n.Topic, true, false, amqp091.Publishing{
		Headers: amqp091.Table{"x-trace-baggage": strings.Repeat("b", pad)},
		Body:    []byte("not json"), DeliveryMode: amqp091.Persistent,
	}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	e.order("after", 1)
	if e.deadLetteredThenAfter(t, stop, 30*time.Second) {
		return
	}
	t.Fatalf("a malformed message with %d bytes of headers: not dead-lettered within 30 s (dlq %v), the event after it applied %d times; poison errors: %v",
		pad, first(e.depth(e.n.DLQ)), e.reservations("after"), tail(e.logs.errors("Poison publish failed"), 3))
}

func first(n int, _ bool) int { return n }
