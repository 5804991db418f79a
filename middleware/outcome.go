package middleware

import (
	"context"
	"time"
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
)

type attemptState struct{ outcome Outcome }

// MarkStale records, from inside a handler, that the event was superseded
// (for example versioned.Upsert.Apply returned Stale): the attempt still
// commits its claim, and is recorded and logged as OutcomeStale instead of
// OutcomeProcessed. It reports false outside the middleware.
func MarkStale(ctx context.Context) bool {
	st, ok := ctx.Value(attemptKey{}).(*attemptState)
	if ok {
		st.outcome = OutcomeStale
	}
	return ok
}

// Observation is one attempt's outcome with its timings.
type Observation struct {
	Consumer string
	Outcome  Outcome
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
