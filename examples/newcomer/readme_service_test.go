package newcomer_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The README's service as written, on the real RabbitMQ and PostgreSQL:
// duplicates (the same event published three times), then poison messages
// (not JSON, an envelope without event_id, a 2 MiB body over the marshaler's
// 1 MiB limit), then a good event after them. Each order is reserved once,
// each poison message reaches the dead-letter queue once, nothing is left
// on the consumer's queue and the event after the poison ones is processed.
func TestNewcomer_READMEServiceDuplicatesAndPoison(t *testing.T) {
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
