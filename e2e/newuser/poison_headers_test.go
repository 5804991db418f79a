package newuser_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// A valid envelope whose payload the README's handler refuses as permanent
// (an array, not an order object), published with 3,000 short headers
// (5-byte keys, 20-byte values: 75 KB of keys and values, 93 KB on the wire,
// under frame_max and amqp091's 8,192 entries), is dead-lettered once and
// the event after it is applied. The copied headers' 64 KiB budget left
// out the largest values first, the envelope's own occurred_at (30 bytes)
// and event_name among them: the copy was no envelope, the marshaler
// refused it at every publish ("metadata event_name: missing"), and the
// delivery was held, nacked and redelivered for ever.
func TestPoisonEnvelopeWithManyShortHeadersIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	stop := e.start(e.n, wiring{retry: func(c *middleware.RetryConfig) { c.MaxHold = 5 * time.Second }})
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	headers := amqp091.Table{}
	for i := 0; i < 3000; i++ {
		headers[fmt.Sprintf("%05d", i)] = "aaaaaaaaaaaaaaaaaaaa" // 20 bytes, shorter than occurred_at
	}
	id := uuid.Must(uuid.NewV7()).String()
	body := fmt.Sprintf(`{"event_id":%q,"event_name":"order.order.placed.v1","occurred_at":%q,"payload":[1]}`,
		id, time.Now().UTC().Format(time.RFC3339Nano))
	if err := ch.Publish(e.n.Exchange, e.n.Topic, true, false, amqp091.Publishing{
		Headers: headers, Body: []byte(body), DeliveryMode: amqp091.Persistent,
	}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	e.order("after", 1)
	if e.deadLetteredThenAfter(t, stop, 60*time.Second) { // failsafe: 12 × MaxHold
		return
	}
	t.Fatalf("an envelope refused as permanent, with 3,000 short headers: not dead-lettered within 60 s (dlq %v), "+
		"the event after it applied %d times; poison errors (%d): %v",
		first(e.depth(e.n.DLQ)), e.reservations("after"), len(e.logs.errors("Poison publish failed")),
		tail(e.logs.errors("Poison publish failed"), 1))
}

// deadLetteredThenAfter polls until the dead-letter queue holds one message
// and the order "after" is reserved once, then stops the service and
// requires the consumer's queue empty (true); false when within (a
// failsafe) passes first.
func (e *env) deadLetteredThenAfter(t *testing.T, stop func() error, within time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) { // polling
		dlq, _ := e.depth(e.n.DLQ)
		if dlq == 1 && e.reservations("after") == 1 {
			_ = stop()
			if n, _ := e.depth(e.n.Queue); n != 0 {
				t.Fatalf("%d message(s) left on the queue", n)
			}
			return true
		}
		time.Sleep(100 * time.Millisecond)
	}
	return false
}
