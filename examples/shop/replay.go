package shop

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

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

// ReplayOutbox republishes, through pub (the events publisher, as the
// relay's), every event of the outbox table (a watermill-sql PostgreSQL
// messages table written through a forwarder publisher, e.g.
// `"watermill_orders_outbox"`, already quoted) whose occurred_at is in
// [from, to), compared at microsecond precision, in outbox order, with its
// original event_id, metadata and payload: what an operator does after an
// incident ("publish again everything from 10:00 to 10:05"). Consumers that
// already processed an event skip it. It returns how many events it
// published; on error, the events before it were published.
func ReplayOutbox(ctx context.Context, pool *pgxpool.Pool, table string, pub message.Publisher, from, to time.Time) (int, error) {
	if !from.Before(to) {
		return 0, fmt.Errorf("shop: replay: empty range [%s, %s)", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))
	}
	rows, err := pool.Query(ctx, `SELECT payload::text FROM `+table+`
	WHERE (payload->'metadata'->>'`+marshaler.MetadataOccurredAt+`')::timestamptz >= $1
	  AND (payload->'metadata'->>'`+marshaler.MetadataOccurredAt+`')::timestamptz < $2
	ORDER BY transaction_id, "offset"`, from, to)
	if err != nil {
		return 0, fmt.Errorf("shop: replay: %w", err)
	}
	var envs []outboxRow
	for rows.Next() {
		var raw string
		if err := rows.Scan(&raw); err != nil {
			rows.Close()
			return 0, fmt.Errorf("shop: replay: %w", err)
		}
		var e outboxRow
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			rows.Close()
			return 0, fmt.Errorf("shop: replay: outbox row: %w", err)
		}
		envs = append(envs, e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("shop: replay: %w", err)
	}
	for i, e := range envs {
		msg := message.NewMessage(e.UUID, e.Payload)
		for k, v := range e.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.SetContext(ctx)
		if err := pub.Publish(e.DestinationTopic, msg); err != nil {
			return i, fmt.Errorf("shop: replay %s: %w", e.UUID, err)
		}
	}
	return len(envs), nil
}

// ReplayOutboxDB is ReplayOutbox on any DB: on PostgreSQL it is
// ReplayOutbox; on SQLite (an outbox of SQLiteSchema) it reads the rows in
// offset order and compares occurred_at in Go, at microsecond precision.
func ReplayOutboxDB(ctx context.Context, db DB, table string, pub message.Publisher, from, to time.Time) (int, error) {
	if db.Pool != nil {
		return ReplayOutbox(ctx, db.Pool, table, pub, from, to)
	}
	if !from.Before(to) {
		return 0, fmt.Errorf("shop: replay: empty range [%s, %s)", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano))
	}
	from, to = from.Truncate(time.Microsecond), to.Truncate(time.Microsecond)
	var envs []outboxRow
	err := db.Query(ctx, `SELECT payload FROM `+table+` ORDER BY "offset"`, nil, func(scan func(...any) error) error {
		var raw []byte
		if err := scan(&raw); err != nil {
			return err
		}
		var e outboxRow
		if err := json.Unmarshal(raw, &e); err != nil {
			return fmt.Errorf("outbox row: %w", err)
		}
		at, err := time.Parse(time.RFC3339Nano, e.Metadata[marshaler.MetadataOccurredAt])
		if err != nil {
			return nil // not an event of ours: never replayed
		}
		if at = at.Truncate(time.Microsecond); !at.Before(from) && at.Before(to) {
			envs = append(envs, e)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("shop: replay: %w", err)
	}
	for i, e := range envs {
		msg := message.NewMessage(e.UUID, e.Payload)
		for k, v := range e.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.SetContext(ctx)
		if err := pub.Publish(e.DestinationTopic, msg); err != nil {
			return i, fmt.Errorf("shop: replay %s: %w", e.UUID, err)
		}
	}
	return len(envs), nil
}
