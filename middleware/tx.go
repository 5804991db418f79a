package middleware

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// PgxTxFromContext returns the attempt's transaction on a pgx DB
// (idempotency.Pgx): write the handler's effects through it, so that they
// commit or roll back with the claim. ok is false outside an attempt. Never
// Commit or Rollback it: the consumer ends it (a handler that does, by call
// or by SQL, fails the attempt).
func PgxTxFromContext(ctx context.Context) (tx pgx.Tx, ok bool) { return inbox.PgxTxFromContext(ctx) }

// SQLTxFromContext returns the attempt's transaction on a database/sql DB
// (idempotency.SQL). ok is false outside an attempt. Never Commit or
// Rollback it.
func SQLTxFromContext(ctx context.Context) (tx *sql.Tx, ok bool) { return inbox.SQLTxFromContext(ctx) }

// PublisherFromContext returns a publisher whose messages are written to
// ConsumerConfig.Outbox in the attempt's transaction (published by the relay
// after the commit, dropped with a rollback). ok is false outside an attempt
// or without an outbox.
func PublisherFromContext(ctx context.Context) (pub message.Publisher, ok bool) {
	return inbox.PublisherFromContext(ctx)
}

// MarkStale records that the handler found the message stale (a versioned
// upsert that applied nothing): the attempt commits and is counted as
// OutcomeStale. It reports whether ctx is an attempt's.
func MarkStale(ctx context.Context) bool { return inbox.MarkStale(ctx) }

// Outcome is how one attempt ended, as counted by a Recorder.
type Outcome = inbox.Outcome

// The outcomes.
const (
	OutcomeProcessed = inbox.OutcomeProcessed // claimed, handler ran, committed
	OutcomeDuplicate = inbox.OutcomeDuplicate // already processed: handler skipped, acked
	OutcomeFailed    = inbox.OutcomeFailed    // error or panic: rolled back
	OutcomeRejected  = inbox.OutcomeRejected  // malformed or invalid event_id: permanent
	OutcomeExpired   = inbox.OutcomeExpired   // older than the replay horizon: permanent
	OutcomeFuture    = inbox.OutcomeFuture    // dated beyond the clock skew: permanent
	OutcomeConflict  = inbox.OutcomeConflict  // event_id reused for another event: permanent
	OutcomeStale     = inbox.OutcomeStale     // committed, the handler marked it stale
	OutcomeObsolete  = inbox.OutcomeObsolete  // committed, superseded in its family
	OutcomeStalled   = inbox.OutcomeStalled   // no attempt finished for a minute while some ran (reported, not an attempt's end)
)

// Observation is one attempt's outcome, handed to a Recorder.
type Observation = inbox.Observation

// Recorder receives one Observation per attempt (ConsumerConfig.Recorder):
// metrics.NewPrometheus, idempotencytest.Outcomes, or your own.
type Recorder = inbox.Recorder

// TxFromContext returns the attempt's transaction in the form the versioned
// tools take (versioned.Upsert.Apply), whichever the driver. ok is false
// outside an attempt.
func TxFromContext(ctx context.Context) (tx idempotency.Tx, ok bool) {
	q, ok := inbox.QuerierFromContext(ctx)
	if !ok {
		return idempotency.Tx{}, false
	}
	return sqldb.WrapTx(q).(idempotency.Tx), true
}
