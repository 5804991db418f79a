package indexer

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// EventProductUpdated is the event name (topic, AMQP routing key) of a
// product update; its payload is ProductUpdated.
const EventProductUpdated = "catalogue.product.updated.v1"

// FamilyKind is the family kind of product updates: the family of an update
// is (FamilyKind, SKU), its sequence number the product's version.
const FamilyKind = "catalogue.product"

// DefaultOutboxTopic is the catalogue's outbox table (outbox.Config.Table).
const DefaultOutboxTopic = "catalogue_outbox"

// Consumer is the indexer's subscription in the shop topology: queue
// "indexer.events", bound to EventProductUpdated; claim key consumer
// "indexer".
var Consumer = shop.Consumer{Name: "indexer", Bindings: []string{EventProductUpdated}}

// ProductUpdated is the payload of EventProductUpdated: the product's full
// state (a snapshot) at Version.
type ProductUpdated struct {
	SKU        string `json:"sku"`
	Version    int64  `json:"version"`
	Name       string `json:"name"`
	PriceCents int64  `json:"price_cents"`
}

const catalogueSchemaSQL = `
CREATE TABLE IF NOT EXISTS catalogue_product (
    sku         text        PRIMARY KEY,
    version     bigint      NOT NULL,
    name        text        NOT NULL,
    price_cents bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
)`

// upsertProductSQL bumps the version in the transaction that writes the
// outbox row carrying it: versions follow the commit order of the row.
const upsertProductSQL = `INSERT INTO catalogue_product (sku, version, name, price_cents) VALUES ($1, 1, $2, $3)
ON CONFLICT (sku) DO UPDATE SET version = catalogue_product.version + 1, name = EXCLUDED.name,
    price_cents = EXCLUDED.price_cents, updated_at = now()
RETURNING version`

// The catalogue's tables on SQLite. updated_at is for display only (nothing
// compares it), so SQLite's CURRENT_TIMESTAMP (whole seconds) will do.
const sqliteCatalogueSchemaSQL = `
CREATE TABLE IF NOT EXISTS catalogue_product (
    sku         TEXT    PRIMARY KEY,
    version     INTEGER NOT NULL,
    name        TEXT    NOT NULL,
    price_cents INTEGER NOT NULL,
    updated_at  TEXT    NOT NULL DEFAULT CURRENT_TIMESTAMP
)`

const sqliteUpsertProductSQL = `INSERT INTO catalogue_product (sku, version, name, price_cents) VALUES (?1, 1, ?2, ?3)
ON CONFLICT (sku) DO UPDATE SET version = catalogue_product.version + 1, name = excluded.name,
    price_cents = excluded.price_cents, updated_at = CURRENT_TIMESTAMP
RETURNING version`

// CatalogueConfig configures NewCatalogue.
type CatalogueConfig struct {
	// Pool is the catalogue's database; its search_path must reach the
	// tables Migrate creates. Exactly one of Pool and DB is required.
	Pool *pgxpool.Pool
	// DB, instead of Pool, is the catalogue's database on SQLite (see
	// shop.SQLiteDB): the outbox and the family store then use the SQLite
	// dialect.
	DB *sql.DB
	// OutboxTopic is the outbox table. Defaults to
	// DefaultOutboxTopic.
	OutboxTopic string
	// Families is the family store whose latest table the catalogue
	// advances. Defaults to versioned.NewFamilyStore with default tables (in
	// Pool's search_path).
	Families *versioned.FamilyStore
	// Latest, when set, records the latest updates there instead (a
	// *redislatest.Store): after each transaction's commit
	// (LatestPublisherConfig.Deferred). Defaults to Families.
	Latest versioned.LatestStore
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Catalogue is the producer: it updates products and publishes their
// updates through its outbox. Safe for concurrent use.
type Catalogue struct {
	db       shop.DB
	upsert   string
	outbox   *outbox.Outbox
	families *versioned.FamilyStore
	latest   versioned.LatestStore
	logger   watermill.LoggerAdapter
}

// NewCatalogue validates cfg (on a copy with defaults applied).
func NewCatalogue(cfg CatalogueConfig) (*Catalogue, error) {
	db := shop.DB{Pool: cfg.Pool, SQL: cfg.DB}
	if cfg.DB != nil {
		db.Dialect = idempotency.SQLite
	}
	if err := db.Validate(); err != nil {
		return nil, fmt.Errorf("indexer: CatalogueConfig.Pool/DB: %w", err)
	}
	if cfg.OutboxTopic == "" {
		cfg.OutboxTopic = DefaultOutboxTopic
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.Families == nil {
		fs, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: db.Dialect})
		if err != nil {
			return nil, err
		}
		cfg.Families = fs
	}
	if cfg.Latest == nil {
		cfg.Latest = cfg.Families
	}
	ob, err := db.Outbox(cfg.OutboxTopic, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("indexer: CatalogueConfig.OutboxTopic: %w", err)
	}
	upsert := upsertProductSQL
	if db.IsSQLite() {
		upsert = sqliteUpsertProductSQL
	}
	return &Catalogue{db: db, upsert: upsert, outbox: ob, families: cfg.Families, latest: cfg.Latest, logger: cfg.Logger}, nil
}

// Migrate creates the product table, the family tables and the outbox
// tables in the pool's search_path. Idempotent.
func (c *Catalogue) Migrate(ctx context.Context) error {
	ddl := catalogueSchemaSQL
	if c.db.IsSQLite() {
		ddl = sqliteCatalogueSchemaSQL
	}
	if err := c.db.Exec(ctx, ddl); err != nil {
		return fmt.Errorf("indexer: migrate catalogue: %w", err)
	}
	if err := c.families.Migrate(ctx, c.db.Handle()); err != nil {
		return err
	}
	return c.outbox.Migrate(ctx)
}

// OutboxTopic is the catalogue's outbox table.
func (c *Catalogue) OutboxTopic() string { return c.outbox.Table() }

// Outbox is the catalogue's outbox (pending counts, replay).
func (c *Catalogue) Outbox() *outbox.Outbox { return c.outbox }

// NewRelay returns the relay from the catalogue's outbox to dest (a
// watermill-amqp publisher of shop.Topology.PublisherConfig in the demo):
// Run it, Close it to stop. It publishes each update to EventProductUpdated,
// at least once, with the event_id it was written with. The relay does not
// close dest.
func (c *Catalogue) NewRelay(dest message.Publisher, cfg outbox.RelayConfig) (*outbox.Relay, error) {
	return c.outbox.NewRelay(dest, cfg)
}

// Replay republishes, through pub (the relay's destination), every relayed
// update of the outbox written in [from, to) (kept for the relay's
// RelayConfig.Retention), with its original event id and family metadata, as
// an operator does after an incident (see shop.ReplayOutbox). The indexer
// skips them: duplicates by their event id.
func (c *Catalogue) Replay(ctx context.Context, pub message.Publisher, from, to time.Time) (int, error) {
	n, err := shop.ReplayOutbox(ctx, c.db, c.outbox, pub, from, to)
	if err != nil {
		return n, fmt.Errorf("indexer: %w", err)
	}
	return n, nil
}

// Update sets a product's name and price in one transaction: the row's
// version goes up by one (1 for a new product), an EventProductUpdated
// snapshot is written to the outbox and the product's latest record is
// advanced to it. It returns the update.
func (c *Catalogue) Update(ctx context.Context, sku, name string, priceCents int64) (ProductUpdated, error) {
	if sku == "" {
		return ProductUpdated{}, errors.New("indexer: empty SKU")
	}
	ev := ProductUpdated{SKU: sku, Name: name, PriceCents: priceCents}
	var pub *versioned.LatestPublisher
	err := c.db.InTx(ctx, func(tx shop.Tx) error {
		if err := tx.Querier.QueryRow(ctx, c.upsert, sku, name, priceCents).Scan(&ev.Version); err != nil {
			return err
		}
		msg, err := marshaler.NewMessage(EventProductUpdated, ev)
		if err != nil {
			return err
		}
		if err := versioned.SetFamilySeq(msg, versioned.Family{Kind: FamilyKind, ID: sku}, ev.Version); err != nil {
			return err
		}
		msg.SetContext(ctx) // the outbox INSERT runs on the message's context
		inner, err := c.outbox.Publisher(tx.Outbox)
		if err != nil {
			return err
		}
		cfg := versioned.LatestPublisherConfig{Store: c.latest, Tx: tx.Tx}
		if !c.latest.Transactional() {
			cfg = versioned.LatestPublisherConfig{Store: c.latest, Deferred: true}
		}
		if pub, err = versioned.NewLatestPublisher(inner, cfg, c.logger); err != nil {
			return err
		}
		return pub.Publish(EventProductUpdated, msg)
	})
	if err != nil {
		return ProductUpdated{}, fmt.Errorf("indexer: update %s: %w", sku, err)
	}
	// Committed: a record held back (Redis) can now name the update. A
	// failure only leaves the product unfiltered.
	if err := pub.Flush(ctx); err != nil {
		c.logger.Error("Latest record of a product update not written", err, watermill.LogFields{"sku": sku})
	}
	return ev, nil
}

// ImportConfig configures Catalogue.Import.
type ImportConfig struct {
	// Products is the number of products, SKUs "p-0001", "p-0002", …
	// Required (> 0).
	Products int
	// UpdatesPerProduct is how many times each product is updated.
	// Required (> 0).
	UpdatesPerProduct int
	// Workers is how many goroutines run the updates, each owning a share of
	// the products (one product's updates are sequential). Defaults to 1.
	Workers int
}

// SKU returns the SKU of product i (1-based) of an import: "p-0001".
func SKU(i int) string { return fmt.Sprintf("p-%04d", i) }

// Import updates every product UpdatesPerProduct times, round after round
// (like an ERP sync re-sending the catalogue), each update in its own
// transaction, and returns the number of updates published. It stops at the
// first error.
func (c *Catalogue) Import(ctx context.Context, cfg ImportConfig) (int, error) {
	if cfg.Products <= 0 || cfg.UpdatesPerProduct <= 0 {
		return 0, fmt.Errorf("indexer: ImportConfig.Products %d and UpdatesPerProduct %d: must be > 0", cfg.Products, cfg.UpdatesPerProduct)
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 1
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		count int
		errs  []error
	)
	for w := 0; w < cfg.Workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := 1; round <= cfg.UpdatesPerProduct; round++ {
				for i := 1 + w; i <= cfg.Products; i += cfg.Workers {
					_, err := c.Update(ctx, SKU(i), fmt.Sprintf("Product %d, revision %d", i, round), int64(1000+i*10+round))
					mu.Lock()
					if err != nil {
						errs = append(errs, err)
					} else {
						count++
					}
					failed := len(errs) > 0
					mu.Unlock()
					if failed {
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	return count, errors.Join(errs...)
}

// Versions returns every product's current version, by SKU.
func (c *Catalogue) Versions(ctx context.Context) (map[string]int64, error) {
	out := map[string]int64{}
	err := c.db.Query(ctx, `SELECT sku, version FROM catalogue_product`, nil, func(scan func(...any) error) error {
		var sku string
		var v int64
		if err := scan(&sku, &v); err != nil {
			return err
		}
		out[sku] = v
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("indexer: versions: %w", err)
	}
	return out, nil
}
