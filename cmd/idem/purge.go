package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// purgePreview is the JSON document of "purge --dry-run".
type purgePreview struct {
	Table string `json:"table"`
	// Purges: processed.Purger deletes from the table now (it keeps a
	// replay horizon in force).
	Purges bool `json:"purges"`
	// TableHorizon is the horizon the table keeps ("" for none); Horizon
	// the one counted by: the purger's (the longer previous one within
	// HorizonChangeGrace of a shortening), or --horizon.
	TableHorizon string   `json:"table_horizon"`
	Horizon      string   `json:"horizon"`
	DatabaseAt   jsonTime `json:"database_now"`
	Cutoff       jsonTime `json:"cutoff"` // rows with event_at < cutoff go
	Rows         int64    `json:"rows"`
	ToDelete     int64    `json:"to_delete"`
	// ToDrop is the rows of the time partitions the purger drops whole
	// (LayoutPartitioned), DropPartitions their names: not in ToDelete,
	// as the purger counts only the rows it deletes.
	ToDrop         int64     `json:"to_drop"`
	DropPartitions []string  `json:"drop_partitions,omitempty"`
	Batches        int64     `json:"batches"`
	Oldest         *jsonTime `json:"oldest,omitempty"`
}

func runPurge(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	dryRun := fs.Bool("dry-run", false, "required: only count (the purger itself runs in the service, processed.Purger)")
	horizonFlag := fs.String("horizon", os.Getenv("IDEM_HORIZON"), "count by this horizon, e.g. 168h ($IDEM_HORIZON); default: the one the purger uses, kept by the table")
	minHorizon := fs.Duration("min-horizon", processedstore.DefaultMinHorizon, "the purger's PurgerConfig.MinHorizon")
	batch := fs.Int("batch-size", processedstore.DefaultPurgeBatchSize, "the purger's PurgerConfig.BatchSize (for the batch count)")
	if _, err := e.parse(fs, args, 0, 0); err != nil {
		return err
	}
	if !*dryRun {
		return usageErr("purge runs only with --dry-run: the purger (processed.Purger) deletes, in the service")
	}
	var horizon time.Duration
	if *horizonFlag != "" {
		var err error
		if horizon, err = time.ParseDuration(*horizonFlag); err != nil {
			return usageErr("--horizon %q: %v", *horizonFlag, err)
		}
		if horizon < *minHorizon {
			return usageErr("--horizon %s is below the minimum %s: the purger would refuse it (%v)", horizon, *minHorizon, processedstore.ErrHorizonTooShort)
		}
	}
	if *batch <= 0 {
		return usageErr("--batch-size %d: must be > 0", *batch)
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
	// What processed.Purger purges by: the table's horizon, or nothing.
	kept, _, _, _, err := store.TableHorizon(ctx, sqldb.Std(db))
	if err != nil {
		return dbErr("purge preview", e.processedTable, err)
	}
	purgerHorizon, purges, err := store.PurgeHorizon(ctx, sqldb.Std(db), time.Now())
	if err != nil {
		return dbErr("purge preview", e.processedTable, err)
	}
	if horizon == 0 && purges && purgerHorizon < *minHorizon {
		return refusedErr("the table %s keeps a horizon of %s, below the minimum %s: the purger refuses it (%v)",
			e.processedTable, purgerHorizon, *minHorizon, processedstore.ErrHorizonTooShort)
	}
	out := purgePreview{Table: e.processedTable, Purges: purges}
	if kept > 0 {
		out.TableHorizon = kept.String()
	}
	if horizon == 0 {
		horizon = purgerHorizon
	}
	if horizon > 0 {
		out.Horizon = horizon.String()
	}
	q, qargs := store.PurgePreviewQuery(horizon)
	var now, cutoff, oldest timeScan
	if err := db.QueryRowContext(ctx, q, qargs...).Scan(&now, &cutoff, &out.Rows, &out.ToDelete, &oldest); err != nil {
		return dbErr("purge preview", e.processedTable, err)
	}
	out.DatabaseAt = jsonTime(now.T)
	if horizon > 0 {
		out.Cutoff = jsonTime(cutoff.T)
	} else {
		out.ToDelete = 0 // counted by no horizon: the purger deletes nothing
	}
	out.Batches = (out.ToDelete + int64(*batch) - 1) / int64(*batch)
	if out.DropPartitions, out.ToDrop, err = store.DropPreview(ctx, sqldb.Std(db), horizon); err != nil {
		return dbErr("purge preview", e.processedTable, err)
	}
	if !oldest.T.IsZero() {
		t := jsonTime(oldest.T)
		out.Oldest = &t
	}
	if e.json {
		return printJSON(e.stdout, out)
	}
	purging := "yes"
	if !purges {
		purging = "no: the table keeps no replay horizon, or recorded one over none within " +
			processedstore.HorizonChangeGrace.String() + " (processed.HorizonChangeGrace)"
	}
	kv := [][2]string{{"table", out.Table}, {"table horizon", dash(out.TableHorizon)}, {"purger runs", purging}}
	if horizon > 0 {
		kv = append(kv, [2]string{"horizon", out.Horizon}, [2]string{"database now", ts(now.T)},
			[2]string{"cutoff", ts(cutoff.T) + " (rows whose event time is before it would be deleted)"})
	}
	kv = append(kv, [2]string{"rows", strconv.FormatInt(out.Rows, 10)},
		[2]string{"would delete", fmt.Sprintf("%d (in %d batch(es) of at most %d)", out.ToDelete, out.Batches, *batch)})
	if len(out.DropPartitions) > 0 {
		kv = append(kv, [2]string{"would drop", fmt.Sprintf("%d row(s) in %d partition(s): %s", out.ToDrop, len(out.DropPartitions), strings.Join(out.DropPartitions, ", "))})
	}
	kv = append(kv,
		[2]string{"oldest", tsPtr(out.Oldest)})
	fields(e.stdout, kv)
	return nil
}
