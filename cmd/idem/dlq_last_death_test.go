package main

import (
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// A message that reached the consumer's queue through RabbitMQ's own
// dead-lettering (a delay queue: per-message TTL, dead-lettered on expiry
// into the consumer's queue, the usual delayed-delivery and delayed-retry
// topology) and that the consumer's queue then dead-lettered (a reject, a
// delivery limit) carries two deaths: x-first-death-queue names the delay
// queue, x-last-death-queue (and x-death's first entry, the latest death)
// the consumer's queue it was dead-lettered from. operations.md: the
// redrive sends it to "the queue RabbitMQ dead-lettered it from", "only
// that queue gets the copy". The list must show the consumer's queue as its
// origin and the redrive must put the copy there, not into the delay queue
// (from which it would be routed again, to every queue bound to its key).
func TestDLQBrokerDeadLetteredTwiceGoesBackToTheQueueItLastDiedIn(t *testing.T) {
	t.Parallel()
	conn, ch := amqpChannel(t)
	delay, q, dlq := testenv.UniqueName("idem_ldelay"), testenv.UniqueName("idem_lq"), testenv.UniqueName("idem_ldlq")
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(delay, true, false, false, false, amqp091.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, name := range []string{delay, q, dlq} {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
	})
	msg, err := marshaler.NewMessage("order.placed", map[string]int{"order": 8})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := idemamqp.Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	pub.Expiration = "1" // delayed delivery: expires in the delay queue, into q
	if err := ch.Publish("", delay, false, false, pub); err != nil {
		t.Fatal(err)
	}
	var d amqp091.Delivery
	eventually(t, "the delayed message in the consumer's queue", func() bool {
		var ok bool
		d, ok, err = ch.Get(q, false)
		return err == nil && ok
	})
	if err := d.Reject(false); err != nil { // the consumer's queue dead-letters it
		t.Fatal(err)
	}
	c := &shop{t: t, conn: conn}
	eventually(t, "the dead letter", func() bool { return c.depth(dlq) == 1 })

	r := idem(t, "public", "dlq", "list", dlq, "--json")
	wantCode(t, r, exitOK)
	m := decode[dlqList](t, r).Messages[0]
	if m.Class != "rejected" {
		t.Errorf("dlq list: class %q (reason %q), want rejected: why the queue dead-lettered it, not why the delay queue did before", m.Class, m.Reason)
	}
	if m.Origin != q {
		t.Errorf("dlq list: origin_queue %q, want %q (the queue it was dead-lettered from; %q is the delay queue it expired from before)", m.Origin, q, delay)
	}
	wantCode(t, idem(t, "public", "dlq", "redrive", dlq, "--all"), exitOK)
	eventually(t, "the redriven copy in a queue", func() bool { return c.depth(q)+c.depth(delay) == 1 })
	if n := c.depth(delay); n != 0 {
		t.Fatalf("the redriven copy went to the delay queue %s (x-first-death-queue), not to %s, the queue that dead-lettered it", delay, q)
	}
}
