package idempotencytest

import (
	"sync"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// Outcomes is a inbox.Recorder that counts attempts by outcome, for
// assertions such as "one processed, two duplicates". Pass it as
// inbox.Config.Recorder. The zero value is ready; it is safe for
// concurrent use.
type Outcomes struct {
	mu sync.Mutex
	n  map[inbox.Outcome]int
}

var _ inbox.Recorder = (*Outcomes)(nil)

// RecordOutcome implements inbox.Recorder.
func (o *Outcomes) RecordOutcome(obs inbox.Observation) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[inbox.Outcome]int{}
	}
	o.n[obs.Outcome]++
}

// Count returns how many attempts ended with outcome out.
func (o *Outcomes) Count(out inbox.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[out]
}
