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
//   - Migrate is safe from several instances at once; MigrationsFS gives the
//     same SQL to goose or golang-migrate.
//   - ClaimIdentity is the same single INSERT storing the event's name and a
//     versioned fingerprint (NewIdentity: SHA-256 of name and payload bytes);
//     on a duplicate, StoredIdentity (one primary-key read) and
//     Identity.Verdict tell the same event (SameEvent) from another one under
//     a reused id (OtherEvent). Migration 0003 adds the two columns in place;
//     rows written before it, by Claim, or with a fingerprint of another
//     version, are Unverified (plain duplicates), never conflicts.
//   - PurgeBatch and Purger delete rows older than a replay horizon in bounded
//     batches, each its own short transaction, with the cutoff taken from the
//     database clock (now() − horizon): neither the process's TZ nor the
//     session's timezone changes it. One Purger works at a time per table
//     across processes (session-level advisory lock); the others skip.
//
// Not guaranteed:
//   - A claim outside a transaction (on a pool) commits by itself and no
//     longer protects anything.
//   - After a row is purged, a redelivery of its event would be claimed
//     again: refuse events older than the horizon (middleware
//     Config.ReplayHorizon, same value as PurgerConfig.Horizon).
//   - Event ids are trusted beyond what the fingerprint checks: a reused id
//     meeting a row without a fingerprint is a duplicate, and the payload is
//     compared byte for byte (a re-encoded replay is OtherEvent). Producers
//     must mint ids (UUIDv7, marshaler.NewMessage).
package processed
