package metrics_test

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/metrics"
)

// The recorder on a registry of its own: pass it as inbox.Config.Recorder
// and its OnPurge(table) as the purgers' OnPurge. A claim of 60 µs lands in
// the (40 µs, 80 µs] bucket of the default buckets.
func ExampleNewPrometheus() {
	reg := prometheus.NewRegistry()
	rec, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	if err != nil {
		panic(err)
	}
	// What the middleware reports for two deliveries of one event.
	rec.RecordOutcome(inbox.Observation{Consumer: "stock", HandlerName: "reserve_stock",
		Outcome: inbox.OutcomeProcessed, Claim: 60 * time.Microsecond, Total: 2 * time.Millisecond})
	rec.RecordOutcome(inbox.Observation{Consumer: "stock", HandlerName: "reserve_stock",
		Outcome: inbox.OutcomeDuplicate, Claim: 55 * time.Microsecond, Total: 70 * time.Microsecond})
	rec.OnPurge("processed_event")(1200, time.Unix(1_700_000_000, 0))

	fmt.Println("attempts:", testutil.CollectAndCount(reg, "idempotency_attempts_total"), "series")
	for _, mf := range must(reg.Gather()) {
		fmt.Println(mf.GetName(), len(mf.GetMetric()))
		if mf.GetName() != "idempotency_claim_duration_seconds" {
			continue
		}
		for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
			if ub := b.GetUpperBound(); ub > 30e-6 && ub < 100e-6 {
				fmt.Printf("  claims ≤ %.0f µs: %d\n", ub*1e6, b.GetCumulativeCount())
			}
		}
	}
	// Output:
	// attempts: 2 series
	// idempotency_attempt_duration_seconds 2
	// idempotency_attempts_total 2
	// idempotency_claim_duration_seconds 1
	//   claims ≤ 40 µs: 0
	//   claims ≤ 80 µs: 2
	// idempotency_last_purge_timestamp_seconds 1
	// idempotency_purged_rows_total 1
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
