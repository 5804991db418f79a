package main

import (
	"context"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// processedRow is one consumer's record of an event.
type processedRow struct {
	Consumer    string   `json:"consumer"`
	ProcessedAt jsonTime `json:"processed_at"`
}

// processedShow is the JSON document of "processed show".
type processedShow struct {
	EventID    string         `json:"event_id"`
	ProducedAt *jsonTime      `json:"produced_at,omitempty"` // UUIDv7 time
	Consumer   string         `json:"consumer,omitempty"`
	Applied    bool           `json:"applied"`
	Records    []processedRow `json:"records"`
}

// runProcessedShow: idem processed show EVENT_ID [--consumer C].
// Exit 0 when applied (by C, or by any consumer), 2 when not.
func runProcessedShow(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	consumer := fs.String("consumer", "", "only this consumer's record (the middleware's Config.Consumer)")
	pos, err := e.parse(fs, args, 1, 1)
	if err != nil {
		return err
	}
	id, err := marshaler.ParseEventID(pos[0])
	if err != nil {
		return usageErr("%q: %v", pos[0], err)
	}
	db, d, err := e.openDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	store, err := processedstore.NewStore(processedstore.Config{Table: e.processedTable, Dialect: d})
	if err != nil {
		return usageErr("--processed-table: %v", err)
	}
	q, qargs := store.LookupQuery(id, *consumer)
	rows, err := db.QueryContext(ctx, q, qargs...)
	if err != nil {
		return dbErr("processed lookup", e.processedTable, err)
	}
	defer rows.Close()
	out := processedShow{EventID: id.String(), Consumer: *consumer, Records: []processedRow{}}
	if id.Version() == 7 {
		sec, nsec := id.Time().UnixTime()
		t := jsonTime(time.Unix(sec, nsec))
		out.ProducedAt = &t
	}
	for rows.Next() {
		var (
			c  []byte
			at timeScan
		)
		if err := rows.Scan(&c, &at); err != nil {
			return dbErr("processed lookup", e.processedTable, err)
		}
		out.Records = append(out.Records, processedRow{Consumer: string(c), ProcessedAt: jsonTime(at.T)})
	}
	if err := rows.Err(); err != nil {
		return dbErr("processed lookup", e.processedTable, err)
	}
	out.Applied = len(out.Records) > 0

	if e.json {
		if err := printJSON(e.stdout, out); err != nil {
			return err
		}
	} else {
		kv := [][2]string{{"event_id", out.EventID}}
		if out.ProducedAt != nil {
			kv = append(kv, [2]string{"produced_at", ts(time.Time(*out.ProducedAt)) + " (UUIDv7 time)"})
		}
		applied := "no"
		if out.Applied {
			applied = "yes"
		}
		if *consumer != "" {
			applied += " (consumer " + *consumer + ")"
		}
		kv = append(kv, [2]string{"applied", applied})
		fields(e.stdout, kv)
		if out.Applied {
			var tr [][]string
			for _, r := range out.Records {
				tr = append(tr, []string{r.Consumer, ts(time.Time(r.ProcessedAt))})
			}
			e.stdout.Write([]byte("\n"))
			table(e.stdout, []string{"CONSUMER", "PROCESSED_AT"}, tr)
		}
	}
	if !out.Applied {
		return quietError{exitNotFound}
	}
	return nil
}
