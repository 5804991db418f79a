// Package versioned holds order-sensitive tools for consumers whose events may
// arrive out of order (redelivery, replays, several producers' relays, retries
// that overtake each other).
//
// # Versioned upsert
//
// A consumer that keeps a copy of another service's state (an order's status,
// a customer's name) writes it with an Upsert: the incoming row carries the
// producer's version, and the stored row only moves forward.
//
//	up, err := versioned.NewUpsert(versioned.UpsertConfig{
//		Table:         "customer_copy",
//		KeyColumns:    []string{"customer_id"},
//		VersionColumn: "version",
//		ValueColumns:  []string{"name"},
//	})
//	...
//	outcome, err := up.Apply(ctx, sqldb.Pgx(tx), []any{ev.CustomerID}, ev.Version, []any{ev.Name})
//
// Guaranteed:
//   - The row is written only when the incoming version is strictly greater
//     than the stored one. An equal or lower version is reported as Stale, with
//     a nil error: the event is superseded, and the caller acknowledges it (and
//     records it as processed) like any other.
//   - A stored NULL version is older than any version, so a legacy row written
//     before versions existed is overwritten by the first versioned event.
//   - An incoming nil version is refused with ErrVersionMissing, a permanent
//     error (it has a Permanent() bool method returning true, which the
//     idempotency middleware routes to the poison topic instead of retrying).
//     A NULL version is never written. Wrong argument counts (ErrArgCount) and
//     nil keys (ErrKeyMissing) are permanent too.
//   - One statement, one round trip, in the caller's transaction (sqldb.Pgx or
//     sqldb.Std over pgx.Tx, *pgxpool.Pool, *sql.Tx, ...): the row commits or
//     rolls back with the handler's other writes and the processed-event claim.
//   - Concurrent writers of one key serialise on the row lock. At READ
//     COMMITTED (PostgreSQL's default) the highest version wins whatever the
//     order in which the transactions commit. At REPEATABLE READ or
//     SERIALIZABLE the losing writer gets SQLSTATE 40001, a transient error to
//     retry, never a row moved backwards.
//   - Identifiers are validated and quoted once, in NewUpsert; values are
//     always bound parameters.
//
// Not guaranteed (the caller's part):
//   - Versions come from the producer and increase per key: typically a row
//     version incremented in the transaction that writes the outbox message.
//     Timestamps from several clocks, or counters assigned at reception, are
//     not versions. Two different states must never share a version: the first
//     one to arrive wins and the other is Stale.
//   - Each event carries the full state of the configured columns (a
//     snapshot, not a delta): versions may be skipped (v1 then v3 applies v3,
//     and a late v2 is Stale), and no gap is detected or waited for.
//   - Only this row is ordered. Other effects of the handler (other tables,
//     messages, e-mails, calls) run for stale events too unless the handler
//     checks Outcome.Applied. Deletes are not special: model them as a
//     versioned tombstone column (for example deleted boolean) among the
//     value columns.
//   - The table must have a primary key or unique constraint on exactly the key
//     columns and a bigint version column; NewUpsert does not check the schema,
//     so a mismatch surfaces as a database error on the first Apply.
package versioned
