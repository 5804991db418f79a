package order

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// outboxRow is the forwarder's envelope as stored in the outbox payload
// column (watermill's components/forwarder format: payload bytes are base64
// in JSON).
type outboxRow struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// Replay republishes, through pub (the events publisher, as the relay's),
// every outbox event whose occurred_at is in [from, to), compared at
// microsecond precision, in outbox order, with its original event_id,
// metadata and payload: what an operator does after an incident ("publish
// again everything from 10:00 to 10:05"). Consumers that already processed
// an event skip it. It returns how many events it published; on error, the
// events before it were published.
func (s *Service) Replay(ctx context.Context, pub message.Publisher, from, to time.Time) (int, error) {
	if !from.Before(to) {
		return 0, fmt.Errorf("order: replay: empty range [%s, %s)", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))
	}
	rows, err := s.pool.Query(ctx, `SELECT payload::text FROM `+s.schema.MessagesTable(s.topic)+`
	WHERE (payload->'metadata'->>'`+marshaler.MetadataOccurredAt+`')::timestamptz >= $1
	  AND (payload->'metadata'->>'`+marshaler.MetadataOccurredAt+`')::timestamptz < $2
	ORDER BY transaction_id, "offset"`, from, to)
	if err != nil {
		return 0, fmt.Errorf("order: replay: %w", err)
	}
	var envs []outboxRow
	for rows.Next() {
		var raw string
		if err := rows.Scan(&raw); err != nil {
			rows.Close()
			return 0, fmt.Errorf("order: replay: %w", err)
		}
		var e outboxRow
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			rows.Close()
			return 0, fmt.Errorf("order: replay: outbox row: %w", err)
		}
		envs = append(envs, e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("order: replay: %w", err)
	}
	for i, e := range envs {
		msg := message.NewMessage(e.UUID, e.Payload)
		for k, v := range e.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.SetContext(ctx)
		if err := pub.Publish(e.DestinationTopic, msg); err != nil {
			return i, fmt.Errorf("order: replay %s: %w", e.UUID, err)
		}
	}
	return len(envs), nil
}
