package shop

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/outbox"
)

// ReplayOutbox republishes, through pub (the events publisher, as the
// relay's), every relayed event of ob in db written in [from, to) (kept in
// the outbox archive: the relay needs RelayConfig.Retention > 0), in outbox
// order, with its original event_id, metadata and payload: what an operator
// does after an incident ("publish again everything from 10:00 to 10:05").
// Consumers that already processed an event skip it. It returns how many
// events it published; on error, the events before it were published. See
// outbox.Outbox.Replay.
func ReplayOutbox(ctx context.Context, db DB, ob *outbox.Outbox, pub message.Publisher, from, to time.Time) (int, error) {
	n, err := ob.Replay(ctx, db.Beginner(), pub, outbox.ReplayFilter{From: from, To: to})
	if err != nil {
		return n, fmt.Errorf("shop: replay: %w", err)
	}
	return n, nil
}
