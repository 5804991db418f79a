// Package processed manages the processed-event table a consumer claims
// events in (middleware.NewConsumer): its schema (Migrate, MigrationsFS),
// its replay horizon (kept in the database with the table, so that every
// consumer and purger of it agrees) and its purge (Purger).
//
// Guarantees: Migrate is idempotent and safe from several instances at
// once; the purge deletes a row only when the claim would refuse its
// redelivery (both judge the event's own time by the database clock against
// the table's one horizon), so a redelivery either finds its row or is
// refused as expired, whatever the clocks of producer and consumer say.
// Not guaranteed: an event older than the horizon is not applied (it is
// poisoned as expired); choose the horizon longer than any replay.
package processed
