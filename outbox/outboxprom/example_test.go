package outboxprom_test

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-idempotency/idempotency/outbox/outboxprom"
)

// The relay's recorder on a registry of its own: pass it as
// outbox.RelayConfig.Recorder; here it is fed by hand and read back.
func Example() {
	reg := prometheus.NewRegistry()
	rec, err := outboxprom.New(outboxprom.Config{Registerer: reg, Outbox: "orders_outbox"})
	if err != nil {
		panic(err)
	}
	rec.Pending(3, 2*time.Second) // what a relay round saw
	rec.Round(2)                  // it published two rows
	rec.DeadLettered("order.placed")

	families, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			fmt.Printf("%s %g\n", f.GetName(), v)
		}
	}
	// Output:
	// idempotency_outbox_dead_lettered_total 1
	// idempotency_outbox_oldest_pending_age_seconds 2
	// idempotency_outbox_pending_rows 3
	// idempotency_outbox_relay_rounds_total 1
	// idempotency_outbox_relayed_total 2
}
