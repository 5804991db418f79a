package versioned

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Test access to the store's plumbing.

func (s *FamilyStore) RecordApplied(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) (bool, error) {
	return s.recordApplied(ctx, q, consumer, f, pos)
}

func (s *FamilyStore) PurgeBatch(ctx context.Context, q sqldb.Querier, horizon time.Duration, limit int) (int64, error) {
	return s.purgeBatch(ctx, q, horizon, limit)
}

func (s *FamilyStore) LatestTable() sqldb.Ident  { return s.latestTable() }
func (s *FamilyStore) AppliedTable() sqldb.Ident { return s.appliedTable() }

// The filter's own per-outcome counter, for tests.
type (
	FilterCounter     = filterCounter
	FilterOutcome     = filterOutcome
	FilterObservation = filterObservation
)

const (
	FilterNoFamily = filterNoFamily
	FilterHandled  = filterHandled
	FilterObsolete = filterObsolete
	FilterStale    = filterStale
	FilterRejected = filterRejected
	FilterFailed   = filterFailed
)

// NewRecordedLatestFilter is NewLatestFilter reporting every attempt to rec.
func NewRecordedLatestFilter(cfg LatestFilterConfig, rec *FilterCounter, logger watermill.LoggerAdapter) (*LatestFilter, error) {
	f, err := NewLatestFilter(cfg, logger)
	if err == nil && rec != nil {
		f.rec = rec
	}
	return f, err
}

// RetireOnPoison is the retirement as a middleware of a chain of one's own.
func (f *LatestFilter) RetireOnPoison(db idempotency.DB) message.HandlerMiddleware {
	return f.retireOnPoisonMiddleware(db)
}
