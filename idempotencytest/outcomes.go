package idempotencytest

import (
	"sync"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// Outcomes is a middleware.Recorder that counts attempts by outcome, for
// assertions such as "one processed, two duplicates". Pass it as
// middleware.ConsumerConfig.Recorder. The zero value is ready; it is safe for
// concurrent use.
type Outcomes struct {
	mu sync.Mutex
	n  map[middleware.Outcome]int
}

var _ middleware.Recorder = (*Outcomes)(nil)

// RecordOutcome implements middleware.Recorder.
func (o *Outcomes) RecordOutcome(obs middleware.Observation) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[middleware.Outcome]int{}
	}
	o.n[obs.Outcome]++
}

// Count returns how many attempts ended with outcome out.
func (o *Outcomes) Count(out middleware.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[out]
}
