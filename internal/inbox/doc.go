// Package middleware is the idempotent-consumer (inbox) middleware for
// Watermill, and the chain that must surround it.
//
// For each attempt it begins a transaction, claims (consumer, event_id) in the
// processed-event table with one INSERT … ON CONFLICT DO NOTHING, skips the
// handler on a duplicate, otherwise runs the handler with that transaction in
// its context, and commits or rolls back claim and effects together.
//
// Guaranteed, for effects the handler writes through the transaction
// (PgxTxFromContext, SQLTxFromContext, QuerierFromContext):
//   - applied once per (consumer, event_id), whatever the redeliveries,
//     relay republishes or replays, as long as the processed row exists (see
//     processed.Config.Horizon and processed.Purger: the claim refuses, by
//     the database clock, what the purge may have removed);
//   - a failed, panicking or crashed attempt leaves neither claim nor effect;
//   - a COMMIT that did not commit (pgx.ErrTxCommitRollback, a broken
//     connection) is a failure, never an ack;
//   - malformed messages (marshaler.Malformed), invalid or nil event ids and
//     expired or future-dated events (refused by the claim statement) fail
//     with a PermanentError;
//   - two deliveries at once: the second waits (at most Config.LockTimeout)
//     and then skips or processes; on timeout it fails with the transient
//     ErrInFlight;
//   - infrastructure failures are transient (ClassOf: by origin, type and
//     SQLSTATE, never by message text or shape alone): the chain holds the
//     delivery and retries it in place, and never poisons it; configuration
//     errors (a missing table or privilege) are held the same way, with an
//     ERROR log;
//   - with Config.Outbox, messages the handler produces are written in the
//     same transaction and relayed after commit, at least once, each with a
//     fixed event_id.
//   - a failed attempt (error, panic, permanent, poisoned) leaves nothing:
//     no claim, no effect, no produced message by any path (none returned
//     to the router, none in the outbox, none from PublisherFromContext),
//     and every beginner releases its connection on every path;
//   - produced messages that could not be relayed as an envelope fail the
//     attempt as permanent (ErrInvalidProduced).
//
// Not guaranteed:
//   - effects outside the transaction (HTTP calls, e-mails, another
//     database): a redelivery after a crash repeats them. Use package
//     operation for external calls, and the outbox for messages.
//   - without an outbox, messages returned to the router are published after
//     the commit; a crash or failed publish in between loses them.
//   - ordering: deliveries may arrive in any order; use package versioned.
//
// The recommended order, which NewChain builds and NewHandlerMiddleware
// composes into one middleware for handler.AddMiddleware: hold and poison →
// retry (the chain's own: the message's context restored before each
// attempt, ordinary errors only) → Recoverer →
// Idempotent → handler.
package inbox
