package idempotencytest_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/middleware"
)

func TestOutcomesCountsConcurrently(t *testing.T) {
	t.Parallel()
	var o idempotencytest.Outcomes
	var wg sync.WaitGroup
	for i := 0; i < 50; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			out := middleware.OutcomeDuplicate
			if i == 0 {
				out = middleware.OutcomeProcessed
			}
			o.RecordOutcome(middleware.Observation{Outcome: out})
		}(i)
	}
	wg.Wait()
	require.Equal(t, 1, o.Count(middleware.OutcomeProcessed))
	require.Equal(t, 49, o.Count(middleware.OutcomeDuplicate))
	require.Zero(t, o.Count(middleware.OutcomeFailed))
}
