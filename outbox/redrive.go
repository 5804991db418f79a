package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// RedriveFilter selects dead-lettered rows (<table>_dead) for Redrive. The
// conditions combine with AND; at least one of EventIDs, Topics or All is
// required, so that an empty filter never moves everything by mistake.
type RedriveFilter struct {
	// EventIDs, when not empty, keeps only rows with one of these event ids
	// (any RFC 9562 text form).
	EventIDs []string
	// Topics, when not empty, keeps only rows for one of these destination
	// topics.
	Topics []string
	// All selects every dead row (with no EventIDs nor Topics).
	All bool
	// DryRun counts the rows Redrive would move and moves nothing.
	DryRun bool
}

// Validate reports the first invalid field, naming it.
func (f RedriveFilter) Validate() error {
	if len(f.EventIDs) == 0 && len(f.Topics) == 0 && !f.All {
		return errors.New("outbox: RedriveFilter: set EventIDs, Topics or All")
	}
	for _, id := range f.EventIDs {
		if id == "" {
			return errors.New("outbox: RedriveFilter.EventIDs: empty event id")
		}
	}
	for _, t := range f.Topics {
		if t == "" {
			return errors.New("outbox: RedriveFilter.Topics: empty topic")
		}
	}
	return nil
}

// redriveChunk bounds the ids moved per statement (bound parameters).
const redriveChunk = 500

// Redrive moves the dead-lettered rows that f selects back to the outbox
// as pending rows, in their original order, in one transaction: each
// keeps its event_id, topic, payload and metadata, and starts again with
// 0 attempts, due at once, written now (a new row id, after the rows
// already pending; its age counts from the redrive). Use it once the cause
// is fixed (a queue bound, a broker limit raised): the relay publishes them
// like any row, and dead-letters them again after MaxAttempts if the cause
// is still there. Consumers that already processed an event skip it. It
// returns how many rows it moved (DryRun: would move).
func (o *Outbox) Redrive(ctx context.Context, f RedriveFilter) (int, error) {
	if err := f.Validate(); err != nil {
		return 0, err
	}
	db := o.beginner()
	var conds []string
	var args []any
	if len(f.EventIDs) > 0 {
		// Each id as given and in its canonical form: Publish stores
		// the canonical form, rows of earlier releases the text the
		// producer wrote.
		ids := make([]string, 0, 2*len(f.EventIDs))
		for _, id := range f.EventIDs {
			ids = append(ids, id)
			if eid, err := marshaler.ParseEventID(id); err == nil && eid.String() != id {
				ids = append(ids, eid.String())
			}
		}
		conds = append(conds, `event_id IN (`+placeholders(o.dialect, len(args)+1, len(ids))+`)`)
		for _, id := range ids {
			args = append(args, id)
		}
	}
	if len(f.Topics) > 0 {
		conds = append(conds, topicIn(o.dialect, len(args)+1, len(f.Topics)))
		for _, t := range f.Topics {
			args = append(args, t)
		}
	}
	where := ""
	if len(conds) > 0 {
		where = ` WHERE ` + strings.Join(conds, ` AND `)
	}
	if f.DryRun {
		var n int
		if err := queryRow(ctx, db, `SELECT count(*) FROM `+o.q.t.Dead+where, args, &n); err != nil {
			return 0, fmt.Errorf("outbox: redrive: %w", err)
		}
		return n, nil
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("outbox: redrive: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	// The ids first (locked where the database can): a row dead-lettered
	// while this runs is neither moved nor deleted.
	lock := ` FOR UPDATE`
	if o.dialect == sqldb.SQLite {
		lock = ""
	}
	rows, err := tx.QueryContext(ctx, `SELECT id FROM `+o.q.t.Dead+where+` ORDER BY id`+lock, args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: redrive: %w", err)
	}
	var ids []any
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			_ = rows.Close()
			return 0, fmt.Errorf("outbox: redrive: %w", err)
		}
		ids = append(ids, id)
	}
	if err := closeRows(rows); err != nil {
		return 0, fmt.Errorf("outbox: redrive: %w", err)
	}
	moved := len(ids)
	for len(ids) > 0 {
		chunk := ids[:min(len(ids), redriveChunk)]
		ids = ids[len(chunk):]
		in := o.q.inIDs(1, len(chunk))
		if _, err := tx.ExecContext(ctx, o.q.at(`INSERT INTO `+o.q.t.Table+` (event_id, topic, payload, metadata, created_at_us) SELECT event_id, topic, payload, metadata, `+
			o.q.now+` FROM `+o.q.t.Dead+` WHERE id`+in+` ORDER BY id`), chunk...); err != nil {
			return 0, fmt.Errorf("outbox: redrive: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+o.q.t.Dead+` WHERE id`+in, chunk...); err != nil {
			return 0, fmt.Errorf("outbox: redrive: %w", err)
		}
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("outbox: redrive: commit: %w", err)
	}
	return moved, nil
}
