package indexer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// DefaultIndexLatency is the time SearchIndex.Put takes when
// NewSearchIndex is given 0: a slow search engine's indexing round trip.
const DefaultIndexLatency = 20 * time.Millisecond

// Document is what the search index holds for one product.
type Document struct {
	SKU        string
	Version    int64
	Name       string
	PriceCents int64
}

// SearchIndex is a fake, slow search index: an in-memory map whose Put
// takes Latency, like a network round trip to Elasticsearch or Algolia.
// Put overwrites (no version check of its own): keeping the newest document
// is the filter's job. Safe for concurrent use.
type SearchIndex struct {
	latency time.Duration
	puts    atomic.Int64
	mu      sync.Mutex
	docs    map[string]Document
}

// NewSearchIndex returns an empty index whose Put takes latency
// (DefaultIndexLatency when 0; negative: none).
func NewSearchIndex(latency time.Duration) *SearchIndex {
	if latency == 0 {
		latency = DefaultIndexLatency
	}
	return &SearchIndex{latency: latency, docs: map[string]Document{}}
}

// Put stores doc under its SKU after the index's latency, or returns ctx's
// error if ctx ends first (nothing stored).
func (s *SearchIndex) Put(ctx context.Context, doc Document) error {
	if s.latency > 0 {
		t := time.NewTimer(s.latency)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
	s.mu.Lock()
	s.docs[doc.SKU] = doc
	s.mu.Unlock()
	s.puts.Add(1)
	return nil
}

// Get returns the document of sku.
func (s *SearchIndex) Get(sku string) (Document, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.docs[sku]
	return d, ok
}

// Len is the number of documents.
func (s *SearchIndex) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.docs)
}

// Puts is the number of successful Put calls since NewSearchIndex.
func (s *SearchIndex) Puts() int64 { return s.puts.Load() }

// IndexerConfig configures NewIndexer.
type IndexerConfig struct {
	// Index receives the documents. Required.
	Index *SearchIndex
	// Families is the indexer's family store: its applied table is in the
	// indexer's database. Defaults to versioned.NewFamilyStore with
	// LatestTable and the default applied table.
	Families *versioned.FamilyStore
	// LatestTable is the catalogue's latest table as the indexer's
	// transactions see it ("catalogue_schema.family_latest" when the
	// catalogue is another schema of the same database). Used only when
	// Families is nil. Defaults to versioned.DefaultLatestTable.
	LatestTable string
	// Latest, when set, is where the catalogue records the latest updates
	// (a *redislatest.Store). Defaults to Families.
	Latest versioned.LatestStore
	// LatestDB, when set, reads the latest table there (the catalogue's
	// database when it is another database):
	// versioned.LatestFilterConfig.LatestDB.
	LatestDB idempotency.DB
	// Dialect is the SQL dialect of the indexer's database, for the default
	// Families: idempotency.PostgreSQL (the default) or idempotency.SQLite.
	Dialect idempotency.Dialect
	// Consumer is the consumer name of the applied records; keep it equal to
	// the consumer's (shop.NewService names it Consumer.Name).
	// Defaults to Consumer.Name ("indexer").
	Consumer string
	// Logger defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Stats are the indexer's counters since NewIndexer.
type Stats struct {
	// IndexUpdates is the number of documents written to the index
	// (successful Put calls from Handle; an attempt whose commit then fails
	// is retried and counted again).
	IndexUpdates int64 `json:"index_updates"`
	// ObsoleteSkipped is the number of attempts acked without indexing
	// because a newer update of the product was published.
	ObsoleteSkipped int64 `json:"obsolete_skipped"`
	// StaleSkipped is the number of attempts acked without indexing because
	// the indexer had already indexed that update or a newer one.
	StaleSkipped int64 `json:"stale_skipped"`
}

// Indexer is the consumer: Handle indexes the latest update of each product.
// Safe for concurrent use.
type Indexer struct {
	index           *SearchIndex
	families        *versioned.FamilyStore
	obsolete, stale atomic.Int64
	handle          message.HandlerFunc
	updates         atomic.Int64
}

// NewIndexer validates cfg (on a copy with defaults applied).
func NewIndexer(cfg IndexerConfig) (*Indexer, error) {
	if cfg.Index == nil {
		return nil, errors.New("indexer: IndexerConfig.Index is required")
	}
	if cfg.Families == nil {
		fs, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: cfg.LatestTable, Dialect: cfg.Dialect})
		if err != nil {
			return nil, fmt.Errorf("indexer: IndexerConfig.LatestTable: %w", err)
		}
		cfg.Families = fs
	}
	if cfg.Consumer == "" {
		cfg.Consumer = Consumer.Name
	}
	ix := &Indexer{index: cfg.Index, families: cfg.Families}
	filter, err := versioned.NewLatestFilter(versioned.LatestFilterConfig{
		Families: cfg.Families,
		Latest:   cfg.Latest,
		LatestDB: cfg.LatestDB,
		Consumer: cfg.Consumer,
	}, cfg.Logger)
	if err != nil {
		return nil, err
	}
	ix.handle = filter.Middleware(ix.put)
	return ix, nil
}

// Migrate creates, in pool's search_path, the processed-event table named by
// table (processed.DefaultTable for the zero Config) and the indexer's family tables (the
// applied table, and the latest table under its configured name, which
// CREATE … IF NOT EXISTS leaves alone when the catalogue made it).
// Idempotent. Its signature is the demo's consumer migration hook.
func (ix *Indexer) Migrate(ctx context.Context, pool *pgxpool.Pool, table processed.Config) error {
	return ix.MigrateDB(ctx, shop.PgxDB(pool), table)
}

// MigrateDB is Migrate on a PostgreSQL or SQLite database.
func (ix *Indexer) MigrateDB(ctx context.Context, db shop.DB, table processed.Config) error {
	if err := processed.Migrate(ctx, db.Handle(), table); err != nil {
		return err
	}
	return ix.families.Migrate(ctx, db.Handle())
}

// Handle is the indexer's handler (a message.NoPublishHandlerFunc, for
// shop.ServiceConfig.Handler): the latest-per-family filter around the
// indexing. It must run inside a middleware.Consumer's attempt
// (versioned.ErrNoTransaction otherwise, permanent). Obsolete and stale
// updates are acked without indexing; a payload that is not a
// ProductUpdated, or disagrees with its family metadata, is a permanent
// error.
func (ix *Indexer) Handle(msg *message.Message) error {
	_, err := ix.handle(msg)
	return err
}

var _ message.NoPublishHandlerFunc = (&Indexer{}).Handle

func (ix *Indexer) put(msg *message.Message) ([]*message.Message, error) {
	var ev ProductUpdated
	if err := json.Unmarshal(msg.Payload, &ev); err != nil {
		return nil, middleware.Permanent(fmt.Errorf("indexer: payload: %w", err))
	}
	if ev.SKU == "" || ev.SKU != msg.Metadata.Get(versioned.MetadataFamilyID) {
		return nil, middleware.Permanent(fmt.Errorf("indexer: payload SKU %q does not match family id %q", ev.SKU, msg.Metadata.Get(versioned.MetadataFamilyID)))
	}
	if err := ix.index.Put(msg.Context(), Document{SKU: ev.SKU, Version: ev.Version, Name: ev.Name, PriceCents: ev.PriceCents}); err != nil {
		return nil, err
	}
	ix.updates.Add(1)
	return nil, nil
}

// Stats returns the counters.
func (ix *Indexer) Stats() Stats {
	return Stats{
		IndexUpdates:    ix.updates.Load(),
		ObsoleteSkipped: ix.obsolete.Load(),
		StaleSkipped:    ix.stale.Load(),
	}
}

// ErrIndexBehind is returned (wrapped) by CheckLatest when the index does not
// hold the latest version of every product.
var ErrIndexBehind = errors.New("indexer: the index does not hold the latest version of every product")

// CheckLatest reports whether index holds, for every product of want (SKU →
// version, Catalogue.Versions), exactly that version, and no product outside
// it. The error wraps ErrIndexBehind and names up to five differences. Poll
// it until nil to know that the indexer has caught up.
func CheckLatest(index *SearchIndex, want map[string]int64) error {
	var diffs []string
	skus := make([]string, 0, len(want))
	for sku := range want {
		skus = append(skus, sku)
	}
	sort.Strings(skus)
	found := 0
	for _, sku := range skus {
		doc, ok := index.Get(sku)
		switch {
		case !ok:
			diffs = append(diffs, fmt.Sprintf("%s: missing (want v%d)", sku, want[sku]))
			continue
		case doc.Version != want[sku]:
			diffs = append(diffs, fmt.Sprintf("%s: v%d (want v%d)", sku, doc.Version, want[sku]))
		}
		found++
	}
	if extra := index.Len() - found; extra > 0 {
		diffs = append(diffs, fmt.Sprintf("%d documents of unknown products", extra))
	}
	if len(diffs) == 0 {
		return nil
	}
	n := len(diffs)
	if n > 5 {
		diffs = append(diffs[:5], "…")
	}
	return fmt.Errorf("%w: %d differences: %s", ErrIndexBehind, n, strings.Join(diffs, "; "))
}

// Recorder returns the consumer's Recorder for the indexer: it counts the
// updates the latest filter skipped (middleware.OutcomeObsolete and
// OutcomeStale, which Stats reports) and hands every observation on to next
// (nil: none). Set it as the indexer's middleware.ConsumerConfig.Recorder.
func (ix *Indexer) Recorder(next middleware.Recorder) middleware.Recorder {
	return skipCounter{ix: ix, next: next}
}

type skipCounter struct {
	ix   *Indexer
	next middleware.Recorder
}

func (c skipCounter) RecordOutcome(o middleware.Observation) {
	switch o.Outcome {
	case middleware.OutcomeObsolete:
		c.ix.obsolete.Add(1)
	case middleware.OutcomeStale:
		c.ix.stale.Add(1)
	}
	if c.next != nil {
		c.next.RecordOutcome(o)
	}
}
