package order

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/outbox"
)

// Replay republishes, through pub (the events publisher, as the relay's),
// every relayed outbox event written in [from, to) (the relay keeps them for
// RelayConfig.Retention), in outbox order, with its original event_id,
// metadata and payload: what an operator does after an incident ("publish
// again everything from 10:00 to 10:05"). Consumers that already processed
// an event skip it. It returns how many events it published; on error, the
// events before it were published. See outbox.Outbox.Replay.
func (s *Service) Replay(ctx context.Context, pub message.Publisher, from, to time.Time) (int, error) {
	n, err := s.ob.Replay(ctx, s.db.Beginner(), pub, outbox.ReplayFilter{From: from, To: to})
	if err != nil {
		return n, fmt.Errorf("order: %w", err)
	}
	return n, nil
}
