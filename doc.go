// Package idempotency holds the database handle, DB, that every component
// of watermill-idempotency takes: one value per database, built with Pgx
// (a pgx v5 pool) or SQL (a database/sql pool and its Dialect).
//
// The components live in sub-packages: middleware (the consumer: claim the
// event and run the handler in one transaction), outbox (the producer),
// processed (migrations and purge of the processed-event table), versioned
// (state copies and latest-per-family), operation (keys for external
// effects), marshaler (the event envelope) and idempotencytest (test
// helpers). Transport adapters are modules of their own under marshaler/.
package idempotency
