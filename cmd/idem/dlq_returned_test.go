package main

import (
	"strings"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// operations.md: in a redrive "a copy that routes nowhere comes back and its
// dead letter stays". Returns are matched to copies by MessageId, and
// flush's comment says a returned copy without one leaves every pending
// copy without one in the queue. Two dead letters without a MessageId
// (foreign messages, dead-lettered verbatim) redriven in one window to a
// headers exchange that routes only the first: the second copy is returned.
// Its return arrives before the first copy's confirm (the first is written
// to a quorum queue, the second is answered at once), is counted against
// the first, and the second's dead letter is acked: no copy anywhere, the
// message is lost.
func TestDLQRedriveReturnedCopyWithoutMessageIDKeepsItsDeadLetter(t *testing.T) {
	t.Parallel()
	conn, ch := amqpChannel(t)
	dlq, target, exchange := testenv.UniqueName("idem_rdlq"), testenv.UniqueName("idem_rtarget"), testenv.UniqueName("idem_rhdr")
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(target, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeHeaders, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(dlq, false, false, false)
		_, _ = ch.QueueDelete(target, false, false, false)
		_ = ch.ExchangeDelete(exchange, false, false)
	})
	if err := ch.QueueBind(target, "", exchange, false, amqp091.Table{"x-match": "all", "region": "eu"}); err != nil {
		t.Fatal(err)
	}
	for _, region := range []string{"eu", "us"} {
		if err := ch.Publish("", dlq, false, false, amqp091.Publishing{
			Headers: amqp091.Table{"region": region}, DeliveryMode: amqp091.Persistent, Body: []byte("foreign " + region),
		}); err != nil {
			t.Fatal(err)
		}
	}
	c := &shop{t: t, conn: conn}
	eventually(t, "the dead letters", func() bool { return c.depth(dlq) == 2 })

	r := idem(t, "public", "dlq", "redrive", dlq, "--all", "--exchange", exchange, "--to", "any")
	wantCode(t, r, exitFailed)
	if !strings.Contains(r.stdout, "returned unroutable") {
		t.Errorf("no copy reported returned: %s", r.stdout)
	}
	eventually(t, "the routed copy", func() bool { return c.depth(target) == 1 })
	got := map[string]int{}
	for {
		d, ok, err := ch.Get(dlq, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		got[string(d.Body)]++
	}
	if got["foreign us"] != 1 {
		t.Fatalf("dead letters left: %v; the returned copy's dead letter (foreign us) was acked: the message is in no queue", got)
	}
}
