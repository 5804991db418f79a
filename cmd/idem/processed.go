package main

import (
	"context"
	"database/sql"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// processedRow is one consumer's record of an event. ProcessedAt is nil
// (JSON null) for a UUIDv7 claim on PostgreSQL, which keeps no time,
// unless the server has track_commit_timestamp on: then it is the claim's
// commit time (processedstore.LookupQuery).
type processedRow struct {
	Consumer    string    `json:"consumer"`
	ProcessedAt *jsonTime `json:"processed_at"`
}

// notRecorded is the PROCESSED_AT of a record that keeps no time.
const notRecorded = "not recorded (a UUIDv7 claim; set track_commit_timestamp = on to see its commit time)"

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
	store, err := e.processedStore(ctx, db, d)
	if err != nil {
		return err
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
		r := processedRow{Consumer: string(c)}
		if !at.T.IsZero() {
			t := jsonTime(at.T)
			r.ProcessedAt = &t
		}
		out.Records = append(out.Records, r)
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
				at := notRecorded
				if r.ProcessedAt != nil {
					at = ts(time.Time(*r.ProcessedAt))
				}
				tr = append(tr, []string{r.Consumer, at})
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

// processedStore is the store of --processed-table as the service
// migrated it: with processedstore.LayoutPartitioned when, on PostgreSQL,
// the table is partitioned and has the layout's side table <table>_other
// (where the rows of ids other than UUIDv7 live), so the read-only
// queries read that table too, and <table>_legacy while the upgrade from
// the plain layout is not finished; a table the user partitioned himself
// is the plain layout, whose queries read <table>_v7 too (processed
// migration 8).
func (e *env) processedStore(ctx context.Context, db *sql.DB, d sqldb.Dialect) (*processedstore.Store, error) {
	cfg := processedstore.Config{Table: e.processedTable, Dialect: d}
	plain, err := processedstore.NewStore(cfg)
	if err != nil {
		return nil, usageErr("--processed-table: %v", err)
	}
	if d != sqldb.PostgreSQL {
		return plain, nil
	}
	id, err := sqldb.ParseIdent(e.processedTable)
	if err != nil {
		return nil, usageErr("--processed-table: %v", err)
	}
	other := id.Name() + "_other"
	if schema, _, ok := strings.Cut(id.String(), "."); ok {
		other = schema + "." + other
	}
	otherID, err := sqldb.ParseIdent(other)
	if err != nil {
		return plain, nil
	}
	var partitioned bool
	err = db.QueryRowContext(ctx, `SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)
		AND to_regclass($2) IS NOT NULL`, id.Quoted('"'), otherID.Quoted('"')).Scan(&partitioned)
	if err != nil {
		return nil, dbErr("processed table layout", e.processedTable, err)
	}
	if !partitioned {
		// <table>_v7, where the pgx consumers claim UUIDv7 events.
		if err := plain.ReadLegacy(ctx, sqldb.Std(db)); err != nil {
			return nil, dbErr("processed table layout", e.processedTable, err)
		}
		return plain, nil
	}
	cfg.Layout = processedstore.LayoutPartitioned
	store, err := processedstore.NewStore(cfg)
	if err != nil {
		return nil, usageErr("--processed-table: %v", err)
	}
	// The rows of an upgrade from the plain layout not finished: the
	// claim still finds them there.
	if err := store.ReadLegacy(ctx, sqldb.Std(db)); err != nil {
		return nil, dbErr("processed table layout", e.processedTable, err)
	}
	return store, nil
}
