package inbox

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// A run of duplicates (issue 25). A duplicate the claim finds costs BEGIN,
// the claim, the read of its identity and ROLLBACK: about 0.8 of a new
// event's instructions (bench part 6), where a read of the processed row in
// autocommit costs under half. A replay (a stream re-read from an earlier
// offset, a relay republishing after a crash, a restore) delivers long
// runs of events already processed, which the broker does not mark as
// redelivered. While most of the consumer's recent claims found
// duplicates, an attempt first reads its event's row on
// Config.CrashQuerier (autocommit, one primary-key read): found, it is a
// duplicate (or a conflict, compared as any duplicate) ended without a
// transaction; not found (or the read failed), the attempt claims as
// always. The read sees committed rows only, so what it finds was applied:
// the decision is the claim's own, never a cache's. A new event arriving
// during a run pays the read once more; the share falls below half after
// a few of them and the reads stop.
//
// The share is a moving average of the outcomes processed, stale or
// obsolete (0) and duplicate or conflict (1) over about the last
// dupWindow claims, in 1/dupScale; other outcomes leave it as it is. Attempts racing on it may
// lose an update, which only moves the average a step.
const (
	dupScale  = 1 << 12
	dupWindow = 16 // the average's weight of the newest outcome: 1/dupWindow
	// dupRunFrom is the share from which an attempt reads first: with the
	// read costing a new event about as much as it saves a duplicate, it
	// pays when most claims are duplicates.
	dupRunFrom = dupScale / 2
)

// duplicateRun reports whether an attempt on ctx reads its row first: the
// consumer is in a run of duplicates (most of its recent claims found the
// event processed), a querier outside the attempt's transaction is set,
// and the attempt has no outer transaction to read through (nested in
// another consumer's attempt, or in watermill-sql's subscriber
// transaction).
func (m *Idempotent) duplicateRun(ctx context.Context, nested bool) bool {
	if m.cfg.CrashQuerier == nil || nested || m.dupShare.Load() < dupRunFrom {
		return false
	}
	_, joined := wsql.TxFromContext(ctx)
	return !joined
}

// noteClaim moves the share of duplicates by one outcome.
func (m *Idempotent) noteClaim(duplicate bool) {
	cur := m.dupShare.Load()
	var target int32
	if duplicate {
		target = dupScale
	}
	next := cur + (target-cur)/dupWindow
	m.dupShare.CompareAndSwap(cur, next)
}

// processedBefore reads (consumer, eventID)'s row in autocommit
// (processedstore.Store.StoredIdentity) during a run of duplicates. A read
// that fails reports nothing found: the attempt claims, and its own
// statements meet the failure. The read is bounded by Config.LockTimeout,
// as the claim's wait on a lock is: behind a lock that blocks reads (an
// ACCESS EXCLUSIVE one: DDL, a partition switch) it gives up, and the
// claim waits its own lock timeout and fails, held and logged, instead of
// the attempt waiting without end and without a word.
func (m *Idempotent) processedBefore(ctx context.Context, consumer string, eventID uuid.UUID) (processedstore.StoredIdentity, bool) {
	if d := m.cfg.LockTimeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	stored, err := m.cfg.Store.StoredIdentity(ctx, m.cfg.CrashQuerier, consumer, eventID)
	if err != nil || !stored.Found {
		return processedstore.StoredIdentity{}, false
	}
	return stored, true
}
