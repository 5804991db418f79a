package main

import (
	"context"
	"fmt"
	"time"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// demoHorizon is the replay horizon of the -partitioned stores.
const demoHorizon = 24 * time.Hour

// processedStore is the store of a consumer's database: nil (the default
// table) unless -partitioned, then processedstore.LayoutPartitioned in schema.
func (d *demo) processedStore(_ context.Context, db shop.DB, schema string) (*processedstore.Store, error) {
	if !d.cfg.Partitioned {
		return nil, nil
	}
	return processedstore.NewStore(processedstore.Config{
		Table:   schema + "." + processedstore.DefaultTable,
		Dialect: db.Dialect,
		Layout:  processedstore.LayoutPartitioned,
		Horizon: demoHorizon,
	})
}

// maintainPartitions runs the purger once, as a service would on its
// interval: it creates the time partitions ahead, so the demo's claims land
// in them rather than in the default partition.
func (d *demo) maintainPartitions(ctx context.Context, db shop.DB, store *processedstore.Store) error {
	if store == nil {
		return nil
	}
	p, err := processedstore.NewPurger(store, sqldb.PgxPool(db.Pool), processedstore.PurgerConfig{}, d.logger)
	if err != nil {
		return err
	}
	if _, _, err := p.PurgeNow(ctx); err != nil {
		return fmt.Errorf("partitions of %s: %w", store.Table(), err)
	}
	return nil
}
