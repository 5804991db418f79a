// Package processed is the processed-event store (the inbox): one row per
// (consumer, event_id) whose effect was committed, in the consumer's own
// database, written in the same transaction as the effect.
//
// Guaranteed:
//   - Claim is one INSERT … ON CONFLICT DO NOTHING: one statement, one round
//     trip, never a SELECT first and never a caught unique violation (which
//     would abort a PostgreSQL transaction: SQLSTATE 25P02). It returns true
//     exactly once per (consumer, event_id) among committed transactions;
//     concurrent claimers serialise on the primary key, the loser waits for
//     the winner's commit (false) or rollback (true).
//   - A claim made in a transaction that rolls back leaves nothing behind
//     (unlike Watermill's in-memory Deduplicator, which records before the
//     handler and never releases).
//   - Migrate applies each version once, recorded next to the table, and is
//     safe from several instances at once; MigrationsFS gives the same SQL to
//     goose or golang-migrate, numbered apart from the other components.
//   - ClaimIdentity is the same single INSERT storing the event's name and a
//     versioned fingerprint (NewIdentity: SHA-256 of name and payload bytes);
//     on a duplicate, StoredIdentity (one primary-key read) and
//     Identity.Verdict tell the same event (SameEvent) from another one under
//     a reused id (OtherEvent). The fingerprint migration adds the two columns in place;
//     rows written before it, by Claim, or with a fingerprint of another
//     version, are Unverified (plain duplicates), never conflicts.
//   - With Config.Horizon, the claim refuses an event dated (event_at: its
//     UUIDv7 time, else occurred_at) before now() − Horizon or after now() +
//     MaxFutureSkew by the database clock, and the purge deletes by the same
//     clock on the same event_at with a horizon NewPurger requires to be ≥
//     the claim's: a redelivery finds its row or is refused, whatever the
//     clocks of producer and consumer say.
//   - PurgeBatch and Purger delete in bounded batches, each its own short
//     transaction, keyed by the primary key (any partitioning works); with
//     LayoutPartitioned the Purger drops whole time partitions once their
//     span is past the horizon. One Purger works at a time per table
//     across processes (session-level advisory lock); the others skip.
//
// Not guaranteed:
//   - A claim outside a transaction (on a pool) commits by itself and no
//     longer protects anything.
//   - An event with neither a UUIDv7 id nor an occurred_at has no time: it is
//     dated when claimed and never refused, so after its row is purged a
//     redelivery would be claimed again.
//   - Event ids are trusted beyond what the fingerprint checks: a reused id
//     meeting a row without a fingerprint is a duplicate, and the payload is
//     compared byte for byte (a re-encoded replay is OtherEvent). Producers
//     must mint ids (UUIDv7, marshaler.NewMessage).
package processedstore
