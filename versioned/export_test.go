package versioned

import (
	"context"
	"time"

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
