package inbox

import (
	"context"
	"database/sql"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// Outcome is what happened to one attempt, as recorded and logged.
type Outcome string

const (
	// OutcomeProcessed: claimed, handler succeeded, committed.
	OutcomeProcessed Outcome = "processed"
	// OutcomeDuplicate: the claim found the event already processed; handler skipped, acked.
	OutcomeDuplicate Outcome = "duplicate"
	// OutcomeFailed: begin, claim, handler or commit failed; rolled back, error returned.
	OutcomeFailed Outcome = "failed"
	// OutcomeRejected: refused before any SQL (malformed, invalid event_id, no consumer); permanent.
	OutcomeRejected Outcome = "rejected"
	// OutcomeExpired: older than Config.ReplayHorizon; refused before any SQL; permanent.
	OutcomeExpired Outcome = "expired"
	// OutcomeStale: claimed and committed, but the handler reported (MarkStale)
	// that the event was superseded and changed nothing (versioned.Stale).
	OutcomeStale Outcome = "stale"
	// OutcomeObsolete: claimed and committed, but the handler reported
	// (MarkObsolete) that a newer message of the same family was already
	// published, so this one was dropped (versioned.LatestFilter).
	OutcomeObsolete Outcome = "obsolete"
	// OutcomeStalled: no attempt of the chain finished for StallAfter while
	// some were in flight (recorded once per report, with the idle time as
	// Total and no handler name); the attempts go on.
	OutcomeStalled Outcome = "stalled"
)

type attemptState struct {
	consumer string
	outcome  Outcome
	outbox   *outbox.Outbox
	tx       attemptTx
	pub      message.Publisher
	// db reaches the attempt's database outside its transaction (the
	// beginner's pool); nil when the beginner has none.
	db sqldb.Querier

	// The transaction as the handler sees it (attemptTx.parts).
	q   sqldb.Querier
	ptx pgx.Tx
	stx *sql.Tx

	// buffered holds what the handler published through
	// PublisherFromContext; it is written to the outbox only once the
	// handler succeeded, and dropped with the attempt otherwise.
	buffered []publishCall
	// refused is the first refusal of PublisherFromContext (an invalid
	// message): it fails the attempt even if the handler ignored it.
	refused error

	// ctx is the handler's context: the attempt's own context carrying
	// the state under sqldb's key, in the state's allocation.
	ctx sqldb.TxContext
}

// stateOf is the attempt's state for tx: in tx's own allocation where it
// has room for it (the pgx beginner's transaction), else a new one.
func stateOf(tx attemptTx) *attemptState {
	if h, ok := tx.(interface{ stateSlot() *attemptState }); ok {
		return h.stateSlot()
	}
	return new(attemptState)
}

// The attempt's state is the one value the middleware puts in the
// handler's context, under sqldb's key (sqldb.TxContext): it is the
// transaction as a sqldb.Querier (QuerierFromContext, library helpers) and
// carries the driver's own transaction (PgxTxFromContext,
// SQLTxFromContext), the consumer, the outcome and the outbox publisher.

// Exec runs query on the attempt's transaction (sqldb.Querier).
func (st *attemptState) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	if st.q != nil {
		return st.q.Exec(ctx, query, args...)
	}
	tag, err := st.ptx.Exec(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// QueryRow runs query on the attempt's transaction (sqldb.Querier).
func (st *attemptState) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	if st.q != nil {
		return st.q.QueryRow(ctx, query, args...)
	}
	return sqldb.Pgx(st.ptx).QueryRow(ctx, query, args...)
}

// stateFrom returns the attempt's state from a handler's context.
func stateFrom(ctx context.Context) (*attemptState, bool) {
	q, ok := sqldb.TxFromContext(ctx)
	if !ok {
		return nil, false
	}
	st, ok := q.(*attemptState)
	return st, ok
}

type publishCall struct {
	topic string
	msgs  []*message.Message
}

func (st *attemptState) publisher() (message.Publisher, error) {
	if st.pub == nil {
		pub, err := st.outbox.Publisher(st.tx.outboxExec())
		if err != nil {
			return nil, err
		}
		st.pub = pub
	}
	return st.pub, nil
}

// MarkObsolete records, from inside a handler, that the event was superseded
// by a newer message of its family and dropped: the attempt commits its claim
// and is recorded and logged as OutcomeObsolete. It reports false outside
// the middleware.
func MarkObsolete(ctx context.Context) bool {
	st, ok := stateFrom(ctx)
	if ok {
		st.outcome = OutcomeObsolete
	}
	return ok
}

// ConsumerFromContext returns, inside a handler run by the middleware, the
// consumer name the claim used (Config.Consumer).
func ConsumerFromContext(ctx context.Context) (string, bool) {
	st, ok := stateFrom(ctx)
	if !ok {
		return "", false
	}
	return st.consumer, true
}

// DBFromContext returns, inside an attempt run by the middleware, a
// querier of the attempt's database outside the attempt's transaction (the
// pool or *sql.DB the beginner opens transactions on): for a write that
// must commit on its own whatever the attempt does, such as the retirement
// of a poisoned message (versioned.LatestFilter, through OnPoison). ok is
// false outside an attempt, and with NewSQLSubscriberBeginner (it joins a
// transaction it did not open and knows no pool).
func DBFromContext(ctx context.Context) (db sqldb.Querier, ok bool) {
	st, ok := stateFrom(ctx)
	if !ok || st.db == nil {
		return nil, false
	}
	return st.db, true
}

// PublisherFromContext returns, inside a handler run by the middleware with
// Config.Outbox set, a publisher that writes into that outbox in the
// attempt's transaction: what it publishes is sent (by the relay) only if the
// attempt commits. ok is false outside the middleware or without an outbox.
//
// Publish checks each message at once (an envelope the relay can send: see
// Middleware) and keeps it in memory; the middleware writes them to the outbox
// after the handler returned successfully, in the same transaction, and drops
// them when the attempt fails. An invalid message, or an empty topic, makes
// Publish return a permanent error wrapping ErrInvalidProduced, and fails the
// attempt even if the handler ignores that error.
func PublisherFromContext(ctx context.Context) (pub message.Publisher, ok bool) {
	st, ok := stateFrom(ctx)
	if !ok || st.outbox == nil {
		return nil, false
	}
	return ctxPublisher{st}, true
}

type ctxPublisher struct{ st *attemptState }

func (p ctxPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := checkTopic(topic)
	for i := 0; err == nil && i < len(msgs); i++ {
		err = checkProduced(msgs[i])
	}
	if err != nil {
		if p.st.refused == nil {
			p.st.refused = err
		}
		return err
	}
	p.st.buffered = append(p.st.buffered, publishCall{topic: topic, msgs: append([]*message.Message(nil), msgs...)})
	return nil
}

// Close is a no-op: the publisher lives as long as the attempt.
func (ctxPublisher) Close() error { return nil }

// MarkStale records, from inside a handler, that the event was superseded
// (for example versioned.Upsert.Apply returned Stale): the attempt still
// commits its claim, and is recorded and logged as OutcomeStale instead of
// OutcomeProcessed. It reports false outside the middleware.
func MarkStale(ctx context.Context) bool {
	st, ok := stateFrom(ctx)
	if ok {
		st.outcome = OutcomeStale
	}
	return ok
}

// Observation is one attempt's outcome with its timings.
type Observation struct {
	// Consumer is the claim's consumer name (Config.Consumer).
	Consumer string
	// HandlerName is the Watermill router handler's name
	// (message.HandlerNameFromCtx); outside a router, the name the
	// consumer was wired to ("idempotencytest" in package idempotencytest).
	HandlerName string
	Outcome     Outcome
	// Claim is the time from the attempt's start to the claim's answer
	// (acquire + BEGIN + claim); zero when no claim ran.
	Claim time.Duration
	// Total is the whole attempt, handler and commit included.
	Total time.Duration
}

// Recorder receives every attempt's Observation; implementations must be safe
// for concurrent use and fast (they run on the message path).
type Recorder interface {
	RecordOutcome(Observation)
}

type nopRecorder struct{}

func (nopRecorder) RecordOutcome(Observation) {}
