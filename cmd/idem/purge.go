package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// purgePreview is the JSON document of "purge --dry-run".
type purgePreview struct {
	Table      string    `json:"table"`
	Horizon    string    `json:"horizon"`
	DatabaseAt jsonTime  `json:"database_now"`
	Cutoff     jsonTime  `json:"cutoff"` // rows with event_at < cutoff go
	Rows       int64     `json:"rows"`
	ToDelete   int64     `json:"to_delete"`
	Batches    int64     `json:"batches"`
	Oldest     *jsonTime `json:"oldest,omitempty"`
}

func runPurge(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	dryRun := fs.Bool("dry-run", false, "required: only count (the purger itself runs in the service, processedstore.Purger)")
	horizonFlag := fs.String("horizon", os.Getenv("IDEM_HORIZON"), "the purger's PurgerConfig.Horizon, e.g. 168h ($IDEM_HORIZON)")
	minHorizon := fs.Duration("min-horizon", processedstore.DefaultMinHorizon, "the purger's PurgerConfig.MinHorizon")
	batch := fs.Int("batch-size", processedstore.DefaultPurgeBatchSize, "the purger's PurgerConfig.BatchSize (for the batch count)")
	if _, err := e.parse(fs, args, 0, 0); err != nil {
		return err
	}
	if !*dryRun {
		return usageErr("purge runs only with --dry-run: the purger (processedstore.Purger) deletes, in the service")
	}
	if *horizonFlag == "" {
		return usageErr("--horizon D is required (the purger's PurgerConfig.Horizon; or set $IDEM_HORIZON)")
	}
	horizon, err := time.ParseDuration(*horizonFlag)
	if err != nil {
		return usageErr("--horizon %q: %v", *horizonFlag, err)
	}
	if horizon < *minHorizon {
		return usageErr("--horizon %s is below the minimum %s: the purger would refuse it (%v)", horizon, *minHorizon, processedstore.ErrHorizonTooShort)
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
	q, qargs := store.PurgePreviewQuery(horizon)
	var (
		now, cutoff, oldest timeScan
		out                 = purgePreview{Table: e.processedTable, Horizon: horizon.String()}
	)
	if err := db.QueryRowContext(ctx, q, qargs...).Scan(&now, &cutoff, &out.Rows, &out.ToDelete, &oldest); err != nil {
		return dbErr("purge preview", e.processedTable, err)
	}
	out.DatabaseAt, out.Cutoff = jsonTime(now.T), jsonTime(cutoff.T)
	out.Batches = (out.ToDelete + int64(*batch) - 1) / int64(*batch)
	if !oldest.T.IsZero() {
		t := jsonTime(oldest.T)
		out.Oldest = &t
	}
	if e.json {
		return printJSON(e.stdout, out)
	}
	fields(e.stdout, [][2]string{
		{"table", out.Table}, {"horizon", out.Horizon}, {"database now", ts(now.T)},
		{"cutoff", ts(cutoff.T) + " (rows whose event time is before it would be deleted)"},
		{"rows", strconv.FormatInt(out.Rows, 10)},
		{"would delete", fmt.Sprintf("%d (in %d batch(es) of at most %d)", out.ToDelete, out.Batches, *batch)},
		{"oldest", tsPtr(out.Oldest)},
	})
	return nil
}
