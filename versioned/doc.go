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
//	outcome, err := up.Apply(ctx, idempotency.PgxTx(tx), []any{ev.CustomerID}, ev.Version, []any{ev.Name})
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
//   - In the caller's transaction (idempotency.PgxTx or idempotency.SQLTx over pgx.Tx,
//     *pgxpool.Pool, *sql.Tx, ...): the row commits or rolls back with the
//     handler's other writes and the processed-event claim. One statement,
//     one round trip, on PostgreSQL (ON CONFLICT … WHERE … RETURNING) and
//     MySQL/MariaDB (ON DUPLICATE KEY UPDATE with IF() per column; rows
//     affected tell inserted, updated and stale apart, so the DSN must not
//     set clientFoundRows=true); two in-process statements on SQLite (insert
//     or nothing, then a guarded update), atomic under SQLite's single
//     writer. UpsertConfig.Dialect selects them.
//   - Concurrent writers of one key serialise on the row lock. At READ
//     COMMITTED (PostgreSQL's default) the highest version wins whatever the
//     order in which the transactions commit. At REPEATABLE READ or
//     SERIALIZABLE the losing writer gets SQLSTATE 40001, a transient error to
//     retry, never a row moved backwards. On MySQL the highest version wins
//     at every isolation level (InnoDB's upsert reads the latest committed
//     row); on SQLite writers take turns for the whole transaction.
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
//     so a mismatch surfaces as a database error on the first Apply
//     (PostgreSQL, SQLite). MySQL cannot tell: its upsert reacts to any unique
//     index, and without one every Apply inserts, so there the table's only
//     unique index must be the primary key on the key columns. Its text
//     key columns compare by their collation, and MySQL's defaults fold
//     case and ignore trailing spaces: "Cust-1" and "cust-1 " are one key,
//     and the second customer's first event is reported Stale against the
//     other's row. Give them VARBINARY (or a binary, no-pad collation), as
//     the library's own tables do.
//
// # Latest per family
//
// Idempotency keeps a second effect of one event from happening; the family
// filter keeps superseded events from reaching the handler at all. A product
// edited 100 times in a second queues 100 "reindex p-123" messages: only the
// last one matters, and an older one that arrives late must not overwrite
// newer work.
//
// A family is (kind, resource id), set by the producer in metadata
// (MetadataFamilyKind, MetadataFamilyID, optional MetadataFamilySeq; see
// SetFamily, SetFamilySeq). Its messages are totally ordered (Position): by
// the producer's sequence number when present, else by occurred_at at full
// precision (parsed, never compared as text; offsets and fractional digits do
// not matter, nanoseconds do), ties broken by event_id in UUID byte order.
//
// Producer side: a LatestPublisher wraps the publisher of the producer's
// transaction (typically the outbox publisher) and advances the family's
// latest record, which never moves backwards:
//
//	inner, _ := ob.PgxPublisher(tx)
//	pub, _ := versioned.NewLatestPublisher(inner, versioned.LatestPublisherConfig{
//		Store: families, Tx: idempotency.PgxTx(tx)}, logger)
//	_ = versioned.SetFamilySeq(msg, versioned.Family{Kind: "catalogue.product", ID: sku}, rowVersion)
//	_ = pub.Publish(topic, msg)
//
// Consumer side: a LatestFilter runs inside the idempotent middleware's
// transaction, directly around the handler:
//
//	poison → retry → recoverer → claim (middleware.Consumer) → LatestFilter → handler
//
// It acks without calling the handler a message older than the family's
// latest record ("obsolete"), and a message not newer than the last one this
// consumer applied for the family ("stale"; the applied position is recorded
// in the handler's transaction, so it commits or rolls back with the effect).
// They are reported to the consumer's Recorder as middleware.OutcomeObsolete
// and middleware.OutcomeStale (the filter marks the attempt). Messages
// without family metadata pass through untouched.
//
// Which store gives which guarantee:
//
//   - Applied positions are always in the handler's database (FamilyStore,
//     the applied table: PostgreSQL, MySQL/MariaDB or SQLite), in its
//     transaction: whatever happens to the latest records, a consumer never
//     applies an older message of a family after a newer one it committed,
//     and one consumer's handlers of one family run one at a time (row lock,
//     bounded by the idempotent middleware's LockTimeout; on SQLite the
//     database's single writer).
//   - Latest records in SQL (FamilyStore, the default): written in the
//     producer's transaction with the outbox rows, so a record exists exactly
//     when its message will be sent; durable; read in the consumer's
//     transaction (on PostgreSQL in the same statement as the applied check,
//     elsewhere just before it). The producers'
//     and the consumer's tables must be in one database, or the consumer sets
//     LatestFilterConfig.LatestDB to a pool on the producers' database.
//   - Latest records in Redis (redislatest.Store, module versioned/redislatest): one key per family, advanced by a
//     compare-and-set Lua script, expiring after a TTL; for producers and
//     consumers that share a Redis but no database. Redis is outside the
//     producer's transaction, so the record is written only once the message
//     is out (after the broker accepted it, or after the producer's commit:
//     LatestPublisherConfig.Deferred and Flush). When a key expires, is
//     evicted or lost in a restart or flush, or when Redis is unreachable, the
//     filter lets the family's messages through to the applied check: more
//     handler runs, never a dropped latest message, never an older message
//     applied after a newer one.
//
// Why the latest message is never dropped: a latest record only ever names a
// message that exists (committed with it, or already sent), and a message is
// dropped as obsolete only when that record is strictly newer; so the
// family's newest message is never older than the record. Losing records only
// lets more through.
//
// A poisoned newest message never freezes its family, by default: a
// message the filter let through and that the library's chain then poisons
// (middleware.OnPoison) is recorded as retired for that consumer (the
// retired table, the applied table's name + "_retired", written on its own
// outside the failed transaction, on LatestFilterConfig.RetireDB or the
// idempotent middleware's database; a failed write holds the message and
// retries it instead of poisoning it). LatestFilterConfig.DisableRetireOnPoison
// opts out. A latest record naming
// a retired message makes nothing obsolete at that consumer: an older
// message of the family that arrives afterwards and is newer than what was
// applied is applied, whichever latest store holds the records (SQL or
// Redis). A newer message published later moves the latest record on, and
// filtering resumes. Retirement is per consumer: another consumer that
// applied the message filters as before. A message dead-lettered as a
// crash loop (reason crash_loop) is retired too, earlier: the delivery that
// dead-letters it never reaches the filter, so the filter retires a message
// it lets through in the last attempt the consumer's crash bound lets run
// (middleware.ConsumerConfig.MaxCrashes), before its handler; a failed
// retirement holds the message. If that attempt succeeds after all,
// nothing is lost but filtering: older messages are stale behind the
// applied one. Not retired, so its family stays frozen at that consumer
// until a newer message is published: a message whose process dies before
// the filter runs in that attempt (in a middleware around the filter), or in
// an attempt that ran uncounted (its start's write failed or its answer was
// lost, and was counted all the same); one on a consumer whose crash bound
// is off; and on SQLite, where the attempt's transaction holds the
// database's only write lock, so a retirement beside it cannot be written.
// Nor is a message that never reaches the filter: one the claim refuses
// (expired, from the future, event_id_reused) or the producer's relay
// dead-letters (<table>_dead: a message too large for the broker). Its
// latest record stands, so the family's older messages are obsolete at
// every consumer until a newer message is published or the dead row is
// redriven once its cause is fixed.
//
// Retention: FamilyPurger deletes families idle for longer than a horizon
// (its three tables: latest, applied, retired; bounded batches, one purger
// at a time under a lock: advisory on PostgreSQL, GET_LOCK on MySQL, per
// process on SQLite; Start/Stop); redislatest.Store keys expire by
// themselves. Choose the horizon ≥
// the idempotent middleware's ReplayHorizon and the longest queue wait (see
// FamilyPurgerConfig).
//
// Not guaranteed:
//   - Latest-only is a choice about effects: messages must be snapshots (the
//     newest carries everything the older ones did), not deltas or commands
//     whose every instance matters.
//   - Messages of a family dropped as obsolete while its newest message was
//     still being retried, before it was poisoned, are not brought back (they
//     were acked); see "A poisoned newest message" above.
//   - Producers own the order: sequence numbers must grow per family, and
//     occurred_at from several unsynchronised clocks only orders as well as
//     those clocks agree. A producer must not stop sending sequence numbers
//     once it started (numbered positions are newer than unnumbered ones).
//   - Obsolete messages still commit their processed-event claim (they are
//     acked); the handler's other effects do not happen for them.
package versioned
