package main

import (
	"context"
	"fmt"
	"time"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/processed"
)

// demoHorizon is the replay horizon of the -partitioned tables.
const demoHorizon = 24 * time.Hour

// processedTable is the processed-event table of a consumer's database: the
// default table unless -partitioned, then processed.LayoutPartitioned in
// schema.
func (d *demo) processedTable(schema string) processed.Config {
	if !d.cfg.Partitioned {
		return processed.Config{}
	}
	return processed.Config{Table: schema + "." + processed.DefaultTable, Layout: processed.LayoutPartitioned}
}

// replayHorizon is the consumers' replay horizon for table: demoHorizon for
// a partitioned table, none otherwise.
func replayHorizon(table processed.Config) time.Duration {
	if table.Layout == processed.LayoutPartitioned {
		return demoHorizon
	}
	return 0
}

// maintainPartitions records the partitioned table's horizon, which the
// consumers then verify (middleware.NewConsumer), and runs the table's
// purger once: it creates the time partitions ahead (a service runs it
// with Start, which keeps creating them and drops the expired ones), so the
// demo's claims land in them rather than in the default partition.
func (d *demo) maintainPartitions(ctx context.Context, db shop.DB, table processed.Config) error {
	if table.Layout != processed.LayoutPartitioned {
		return nil
	}
	if err := processed.SetReplayHorizon(ctx, db.Handle(), table.Table, demoHorizon); err != nil {
		return fmt.Errorf("horizon of %s: %w", table.Table, err)
	}
	p, err := processed.NewPurger(processed.PurgerConfig{DB: db.Handle(), Table: table.Table, Layout: table.Layout}, d.logger)
	if err != nil {
		return err
	}
	if _, _, err := p.PurgeNow(ctx); err != nil {
		return fmt.Errorf("purge of %s: %w", table.Table, err)
	}
	return nil
}
