package idempotencytest_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

func TestOutcomesCountsConcurrently(t *testing.T) {
	t.Parallel()
	var o idempotencytest.Outcomes
	var wg sync.WaitGroup
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			out := inbox.OutcomeDuplicate
			if i == 0 {
				out = inbox.OutcomeProcessed
			}
			o.RecordOutcome(inbox.Observation{Outcome: out})
		}(i)
	}
	wg.Wait()
	require.Equal(t, 1, o.Count(inbox.OutcomeProcessed))
	require.Equal(t, 49, o.Count(inbox.OutcomeDuplicate))
	require.Zero(t, o.Count(inbox.OutcomeFailed))
}
