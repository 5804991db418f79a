// Package operation makes external effects (a card charged, a parcel booked,
// a document filed at a provider) happen effectively once per operation, from
// Watermill handlers that run at least once.
//
// A database transaction cannot undo a charge. When a handler calls a
// provider and then crashes, or the call times out, the provider may have
// acted while the database knows nothing; the message comes back. This
// package gives the operation an identity that every attempt reuses, records
// that identity before the call, and never calls again on a guess.
//
// # Use
//
//	key := operation.MustKey("charge", paymentID)               // "charge:p-1"
//	params := map[string]any{"amount": 100, "currency": "EUR"}  // what defines the request
//	res, err := runner.Do(ctx, key, params,
//	    func(ctx context.Context, key string) (operation.Result, error) {
//	        id, err := provider.Charge(ctx, key, 100, "EUR")    // key = provider's idempotency key
//	        switch {
//	        case errors.Is(err, ErrDeclined):    return operation.Result{}, operation.Rejected(err)
//	        case errors.Is(err, ErrUnavailable): return operation.Result{}, operation.Transient(err)
//	        case err != nil:                     return operation.Result{}, operation.Timeout(err)
//	        }
//	        return operation.Result{Reference: id}, nil
//	    },
//	    operation.WithReconcile(func(ctx context.Context, rec operation.Record) (operation.Result, error) {
//	        c, found, err := provider.Lookup(ctx, rec.Key)
//	        ...                                  // found → Result; !found → operation.ErrNotFound
//	    }))
//
// The handler returns err as is: every error Do returns says whether it is
// permanent or transient (methods Permanent() bool / Transient() bool), which
// the middleware chain reads. Put RouteUncertain in the chain to send the
// uncertain outcomes no reconcile function can settle to a reconciliation
// topic, and Resolve them from there.
//
// Do works beside the idempotent middleware, not inside its transaction: the
// event's claim and the handler's local writes stay in the middleware's
// transaction; the operation record is written on a connection of its own,
// in short transactions that commit before and after the call, so the
// "started" evidence survives a rollback or a crash of the handler.
//
// # Identity
//
// A Key names the operation: kind, entity and, if needed, intent
// ("charge:p-1", "refund:p-1:partial-2"), never the attempt. Derive it from
// business identifiers only, so that a retry, a redelivery, a replay by an
// operator and a copy of the event republished under a new event id all
// produce the same key. The key is passed to the provider as its idempotency
// key.
//
// The parameters that define the request are fingerprinted (SHA-256 of
// their canonical JSON; see Canonical for exactly what counts as equal) and
// stored with the key. The same request fingerprints the same however it is
// written: members in any order, numbers in any spelling, a time.Time or an
// RFC 3339 string in any offset or zone (TZ=Europe/Paris, in which pgx
// returns timestamptz values, changes nothing). Text that is not valid
// (invalid UTF-8 in a Go string, a lone surrogate escape in JSON) is refused
// with ErrInvalidParams, never replaced. Each fingerprint carries its version
// (FingerprintVersion, "v2:"), and a stored one is compared with the
// algorithm of its own version (SameRequest): a change of the canonical form
// never turns a stored record into a conflict. The same key with another fingerprint is a
// ConflictError, permanent, returned before any call. The fingerprint is
// compared on every path that returns an existing record: stored success,
// stored failure, uncertain, started by a dead or by a live worker. (Serving
// a stored result without that comparison is the bug AWS Lambda Powertools
// had in three runtimes: #3781, #2058, #2260.)
//
// # Databases
//
// PostgreSQL through pgx (Config.Pool) or database/sql (Config.DB with pgx's
// stdlib); MySQL 8.0+ and MariaDB 10.11+ through database/sql
// (go-sql-driver/mysql, Config.Dialect idempotency.MySQL); SQLite through
// database/sql (modernc.org/sqlite, idempotency.SQLite). The protocol and the
// guarantees below are the same on the three, with these differences:
//
//   - The key's lock: a session-level advisory lock on PostgreSQL; a
//     user-level lock (GET_LOCK, also session-level, also surviving COMMIT)
//     on MySQL, whose wait is in whole seconds (Config.Wait rounded up); on
//     SQLite, which has no session locks, a lock of the process, per
//     database file, table and key (the table as SQLite identifies it:
//     "operation", "main.operation" and "OPERATION" are one table, one
//     lock). SQLite's guarantee is therefore per process:
//     run one process per database file (the usual way to use SQLite). Two
//     processes on one file do not see each other's locks, so both could
//     call the provider for one key at once. A crashed process's locks go
//     with it, as a crashed session's do, and a record it left started is
//     uncertain for the next attempt, as on the other databases.
//   - The claim is one statement on PostgreSQL (a data-modifying CTE), an
//     insert-or-nothing then a read on MySQL and SQLite; both under the
//     key's lock, so no other attempt writes between them.
//   - The window "the connection of a live attempt breaks during its call"
//     below does not exist on SQLite (no session to lose).
//   - On SQLite the runner's records live in a database file of their own,
//     never the file of the idempotent middleware's transactions (one
//     writer per file: the started record could not commit while the
//     handler's transaction holds the write lock). NewRunner and
//     middleware.NewConsumer refuse that wiring in a process, whichever
//     is built second (ErrSharedSQLiteFile).
//
// # Liveness: who holds a key
//
// Do holds the key's lock (see Databases; the words below are
// PostgreSQL's), on its own pool connection, from before the started record
// is committed until the outcome is recorded. Advisory lock numbers hash the
// key with the table's OID: Runners on different tables, or schemas, never
// wait for each other. Another worker that finds the lock taken knows the
// holder's session is alive and waits (Config.Wait) or gets an
// InProgressError (transient). A worker that gets the lock and finds the
// record started with an owner knows that owner's session ended without
// recording an outcome: its call may have happened, so the outcome is
// uncertain. The lock was chosen over a lease (owner + expiry time) because
// it needs no clock, no heartbeat and no lease length to tune: a crashed
// process's connection closes and the server releases the lock at once,
// while a slow but live call keeps it however long it takes.
//
// The windows of that choice:
//
//   - The lock follows the database session, not the process. If the
//     connection of a live attempt breaks during its call (server restart,
//     network cut), the lock goes, and another worker can take the key over
//     while the first call is still running: it then reconciles, and its
//     lookup may not see the in-flight request yet (ErrNotFound), so it
//     calls with the same key. Only the provider's own deduplication by key
//     prevents a second effect then. The first attempt's outcome write finds
//     it no longer owns the record and returns ErrLostOwnership (transient).
//   - A session the server does not know is dead (a half-open connection
//     after a network partition, a frozen host) keeps the lock until TCP
//     keepalive or tcp_user_timeout ends it. Meanwhile other workers get
//     InProgressError: safe, but the key is stuck for that long.
//   - Each Do in flight holds one pool connection for the duration of the
//     external call (no transaction is open on it meanwhile). A
//     transaction-mode pooler (PgBouncer pool_mode=transaction, ProxySQL
//     with multiplexing) breaks session locks: use a direct or session-mode
//     pool.
//
// # Guaranteed
//
//   - Per key, at most one attempt at a time calls the provider (under the
//     windows above), and a later attempt calls again only when the record
//     says the last call certainly did nothing (Transient, or a reconcile
//     function or Resolve reporting not executed).
//   - The started record is committed before the call; a crash at any point
//     after that leaves a record that the next attempt treats as uncertain.
//   - An uncertain outcome is settled only by a lookup (ReconcileFunc) or by
//     Resolve; without a reconcile function it becomes a permanent
//     UncertainError carrying the key and reference, for the reconciliation
//     topic, once per delivery (RouteUncertain).
//   - A succeeded key returns its recorded Result (Reference and Data) to
//     every later call with the same parameters, without calling; a failed
//     key returns its FailedError.
//   - A record is never deleted, and moved only by the attempt that owns it
//     (an owner token, checked by every outcome write), or by an attempt or
//     Resolve that took the key's lock after the owner's session ended.
//   - Outcome writes run on a context detached from the handler's, bounded
//     by Config.WriteTimeout: a cancelled handler does not lose a charge
//     that went through.
//
// # Not guaranteed
//
//   - Exactly one effect at the provider. That needs the provider's help:
//     a provider that honours idempotency keys for long enough (to be checked
//     in its documentation: Stripe keeps keys 24 hours) or that can be asked
//     by key. With neither (a mailer, most SMTP relays), an uncertain outcome
//     can only be settled by a person, and the choice is between a possible
//     duplicate and a possible loss.
//   - That the provider compares parameters. Our fingerprint check stops a
//     key reused for another request before it leaves the process; a second
//     system using the same keys is not covered.
//   - Anything about the handler's local writes: they belong to the
//     middleware's transaction and roll back on error, while the operation
//     record does not. A handler that fails after Do succeeded gets the
//     stored result on its next attempt (OriginStored) and must do its local
//     writes then.
//   - Progress: a key stays uncertain until reconciled or resolved, and a
//     reconcile function that keeps returning Transient keeps the message
//     coming back.
//   - Fingerprint stability across a change of what the handler puts in
//     params: adding a field to the parameters of a key already used makes
//     every later call with it a conflict. Version the key's kind instead.
//   - Retention: records are kept forever by this package; purge succeeded
//     and failed ones older than the provider's key retention yourself, if at
//     all.
package operation
