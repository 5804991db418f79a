// Package indexer is the example shop's search indexing: a catalogue import
// that updates products many times, and an indexer that pushes each product
// to a slow search index, processing only the latest update of each product.
//
// Producer side (Catalogue): every update is one transaction that bumps the
// product row's version, writes an EventProductUpdated snapshot to the
// catalogue's outbox and, through a versioned.LatestPublisher, advances the
// family's latest record. The family is (FamilyKind, SKU) and its sequence
// number is the row version, so the order is the database's commit order of
// the product row.
//
// Consumer side (Indexer): Handle runs inside the consumer attempt's
// transaction (it is the shop.ServiceConfig.Handler, attached through
// middleware.NewConsumer, so the chain is poison → retry and hold →
// recoverer → claim → LatestFilter → index).
// Updates older than the product's latest record are acked as obsolete
// without touching the index; updates not newer than the last one indexed
// are acked as stale; the rest are written to the SearchIndex.
//
// What the counters mean after a run (Indexer.Stats): IndexUpdates is how
// many documents the index received (without the filter: one per update);
// ObsoleteSkipped and StaleSkipped are the updates acked without indexing.
// CheckLatest is the run's verdict: the index holds, for every product, the
// version the catalogue holds.
//
// Database layout: the catalogue and the indexer may live in two schemas
// (two search_paths) of one database, as in the demo. The indexer then reads
// the catalogue's latest table by its qualified name
// (IndexerConfig.LatestTable = catalogueSchema + ".family_latest"), in its
// own handler transaction, in the same statement as its applied check. With
// two databases, set IndexerConfig.LatestDB to the catalogue's database
// (idempotency.Pgx or idempotency.SQL); with Redis, set CatalogueConfig.Latest and
// IndexerConfig.Latest to one redislatest.Store (module versioned/redislatest).
package indexer
