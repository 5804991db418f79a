package order

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/examples/shop"
)

// Replay republishes, through pub (the events publisher, as the relay's),
// every outbox event whose occurred_at is in [from, to), compared at
// microsecond precision, in outbox order, with its original event_id,
// metadata and payload: what an operator does after an incident ("publish
// again everything from 10:00 to 10:05"). Consumers that already processed
// an event skip it. It returns how many events it published; on error, the
// events before it were published. See shop.ReplayOutbox.
func (s *Service) Replay(ctx context.Context, pub message.Publisher, from, to time.Time) (int, error) {
	n, err := shop.ReplayOutboxDB(ctx, s.db, shop.OutboxTable(s.db, s.topic), pub, from, to)
	if err != nil {
		return n, fmt.Errorf("order: %w", err)
	}
	return n, nil
}
