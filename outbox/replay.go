package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// ReplayFilter selects archived (relayed) rows for Replay.
type ReplayFilter struct {
	// From and To bound the rows' write time (when the producer wrote them
	// to the outbox): From ≤ t < To, at microsecond precision. Required,
	// From before To.
	From, To time.Time
	// Topics, when not empty, keeps only rows for these destination topics.
	Topics []string
	// DryRun counts the rows Replay would publish and publishes nothing.
	DryRun bool
}

// Validate reports the first invalid field, naming it.
func (f ReplayFilter) Validate() error {
	if f.From.IsZero() || f.To.IsZero() || !f.From.Before(f.To) {
		return fmt.Errorf("outbox: ReplayFilter.From/To: empty range [%s, %s)", f.From.Format(time.RFC3339Nano), f.To.Format(time.RFC3339Nano))
	}
	for _, t := range f.Topics {
		if t == "" {
			return errors.New("outbox: ReplayFilter.Topics: empty topic")
		}
	}
	return nil
}

// Replay publishes again, through dest, the relayed rows kept in the
// archive (RelayConfig.Retention > 0) that f selects, in outbox order, each
// with its original event_id (message UUID), payload and metadata: what an
// operator does after an incident ("publish again everything from 10:00 to
// 10:05"). Consumers that already processed an event skip it. Rows older
// than the retention are gone; pending rows are not replayed (the relay will
// publish them). It returns how many rows it published (DryRun: would
// publish); on error, the rows before it were published.
func (o *Outbox) Replay(ctx context.Context, db wsql.ContextExecutor, dest message.Publisher, f ReplayFilter) (int, error) {
	if err := f.Validate(); err != nil {
		return 0, err
	}
	if dest == nil && !f.DryRun {
		return 0, errors.New("outbox: Replay: nil publisher")
	}
	args := []any{f.From.UnixMicro(), f.To.UnixMicro()}
	cond := ""
	if len(f.Topics) > 0 {
		cond = ` AND ` + topicIn(o.dialect, 3, len(f.Topics))
		for _, t := range f.Topics {
			args = append(args, t)
		}
	}
	if onPgx(db) {
		args = sqldb.WithMode(o.mode, args)
	}
	rows, err := db.QueryContext(ctx, fmt.Sprintf(o.q.replay, cond), args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: replay: %w", err)
	}
	type archived struct {
		topic string
		msg   *message.Message
	}
	var out []archived
	for rows.Next() {
		var id, createdUs int64
		var eventID, topic, metadata string
		var payload []byte
		if err := rows.Scan(&id, &eventID, &topic, &payload, &metadata, &createdUs); err != nil {
			_ = rows.Close()
			return 0, fmt.Errorf("outbox: replay: %w", err)
		}
		msg, err := rowMessage(eventID, payload, metadata)
		if err != nil {
			_ = rows.Close()
			return 0, fmt.Errorf("outbox: replay row %d: %w", id, err)
		}
		out = append(out, archived{topic, msg})
	}
	if err := closeRows(rows); err != nil {
		return 0, fmt.Errorf("outbox: replay: %w", err)
	}
	if f.DryRun {
		return len(out), nil
	}
	for i, a := range out {
		a.msg.SetContext(ctx)
		if err := dest.Publish(a.topic, a.msg); err != nil {
			return i, fmt.Errorf("outbox: replay %s: %w", a.msg.UUID, err)
		}
	}
	return len(out), nil
}
