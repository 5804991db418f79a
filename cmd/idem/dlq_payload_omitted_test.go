package main

import (
	"context"
	"strings"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// A dead letter published without its payload (the poison topic refused
// the whole copy: inbox.MetadataPayloadOmitted) is left in the queue by a
// redrive, which says why: its empty body is no event to deliver.
func TestDLQRedriveLeavesADeadLetterWithoutItsPayload(t *testing.T) {
	t.Parallel()
	s := newShop(t)
	ch, err := s.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	err = ch.PublishWithContext(context.Background(), "", s.dlq, true, false, amqp091.Publishing{
		MessageId: "01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b",
		Headers: amqp091.Table{
			inbox.MetadataPayloadOmitted: "1048000 bytes; the poison topic refused the whole copy: message too large",
			"idempotency_origin_queue":   s.queue,
			"reason_poisoned":            "idempotency: malformed message: envelope: not JSON",
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the dead letter in the DLQ", func() bool { return s.depth(s.dlq) == 1 })

	r := idem(t, s.schema, "dlq", "redrive", s.dlq, "--all", "--json")
	wantCode(t, r, exitFailed)
	rep := decode[redriveReport](t, r)
	if rep.Redriven != 0 || rep.Left != 1 || len(rep.Items) != 1 || !strings.Contains(rep.Items[0].Result, "without its payload") {
		t.Fatalf("redrive: %+v", rep)
	}
	if d, q := s.depth(s.dlq), s.depth(s.queue); d != 1 || q != 0 {
		t.Fatalf("DLQ %d (want 1), queue %d (want 0)", d, q)
	}
}
