package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
)

// result is the run's report; its JSON form is the last line of stdout.
type result struct {
	Orders               int     `json:"orders"`
	Events               int     `json:"events"`
	Deliveries           int64   `json:"deliveries"`
	Redelivered          int64   `json:"redelivered"`
	Reservations         int     `json:"reservations"`
	ExpectedReservations int     `json:"expected_reservations"`
	DuplicatesSkipped    int64   `json:"duplicates_skipped"`
	StaleSkipped         int64   `json:"stale_skipped"`
	Poisoned             int     `json:"poisoned"`
	ExpectedPoisoned     int     `json:"expected_poisoned"`
	Lost                 int     `json:"lost"`
	RelayRepublished     int64   `json:"relay_republished"`
	Replayed             int     `json:"replayed"`
	ConnectionCuts       int64   `json:"connection_cuts"`
	Malformed            int     `json:"malformed"`
	Reordered            int64   `json:"reordered"`
	WallSeconds          float64 `json:"wall_seconds"`
	OK                   bool    `json:"ok"`

	id     string
	seed   uint64
	rows   []checkRow
	stock  counts
	ship   counts
	reason []string
}

type counts struct {
	deliveries, redelivered, duplicates, processed, stale int64
}

// checkRow is one verified invariant: expected and actual values.
type checkRow struct {
	name             string
	expected, actual int
}

func (r checkRow) ok() bool { return r.expected == r.actual }

// check verifies, from the databases and the queues, after the shutdown:
// every order line reserved once (rows, quantities, per-SKU totals), every
// status copy at the order's version, every event processed once by each
// consumer, every malformed message once in each dead-letter queue and
// nothing else there, nothing left in the queues or in the outbox.
func (d *demo) check(ctx context.Context) (*result, error) {
	o, s, sh := d.orderSchema, d.stock.schema, d.shipping.schema
	one := func(q string) (int, error) {
		var n int
		err := d.admin.QueryRow(ctx, q).Scan(&n)
		return n, err
	}
	r := &result{
		Orders:           d.cfg.Orders,
		Malformed:        len(d.malformedIDs),
		RelayRepublished: d.flaky.republished.Load(),
		Replayed:         d.replayed,
		Reordered:        d.reorder.reordered.Load(),
		id:               d.id,
		seed:             d.cfg.Seed,
	}
	var err error
	queries := []struct {
		dst *int
		sql string
	}{
		{&r.ExpectedReservations, `SELECT count(*) FROM ` + o + `.order_line`},
		{&r.Reservations, `SELECT count(*) FROM ` + s + `.reservation`},
		{&r.Events, `SELECT coalesce(sum(version), 0)::int FROM ` + o + `.orders`},
	}
	for _, q := range queries {
		if *q.dst, err = one(q.sql); err != nil {
			return nil, err
		}
	}
	missingLines, err := one(`SELECT count(*) FROM ` + o + `.order_line l WHERE NOT EXISTS (
		SELECT 1 FROM ` + s + `.reservation r WHERE r.order_id = l.order_id AND r.line_no = l.line_no AND r.sku = l.sku AND r.quantity = l.quantity)`)
	if err != nil {
		return nil, err
	}
	extraReservations, err := one(`SELECT count(*) - count(DISTINCT (order_id, line_no)) FROM ` + s + `.reservation`)
	if err != nil {
		return nil, err
	}
	strayReservations, err := one(`SELECT count(*) FROM ` + s + `.reservation r WHERE NOT EXISTS (
		SELECT 1 FROM ` + o + `.order_line l WHERE r.order_id = l.order_id AND r.line_no = l.line_no)`)
	if err != nil {
		return nil, err
	}
	skuMismatch, err := one(`SELECT count(*) FROM (SELECT sku, sum(quantity) AS q FROM ` + o + `.order_line GROUP BY sku) e
		FULL JOIN ` + s + `.stock_level k USING (sku) WHERE e.q IS DISTINCT FROM k.reserved`)
	if err != nil {
		return nil, err
	}
	skus, err := one(`SELECT count(DISTINCT sku) FROM ` + o + `.order_line`)
	if err != nil {
		return nil, err
	}
	copiesCurrent, err := one(`SELECT count(*) FROM ` + o + `.orders x JOIN ` + sh + `.order_status_copy c USING (order_id)
		WHERE c.version = x.version AND c.status = x.status`)
	if err != nil {
		return nil, err
	}
	stockProcessed, err := one(`SELECT count(*) FROM ` + s + `.processed_event`)
	if err != nil {
		return nil, err
	}
	shipProcessed, err := one(`SELECT count(*) FROM ` + sh + `.processed_event`)
	if err != nil {
		return nil, err
	}
	pending, err := d.orders.Pending(ctx, "")
	if err != nil {
		return nil, err
	}
	queued, err := d.queued()
	if err != nil {
		return nil, err
	}
	dlq, err := d.drainDeadLetters()
	if err != nil {
		return nil, err
	}

	// Dead letters: each malformed message once per queue, with a reason,
	// and nothing else.
	r.ExpectedPoisoned = 2 * len(d.malformedIDs)
	dlqExact := 0
	for _, c := range []string{stock.Consumer.Name, shipping.Consumer.Name} {
		got := dlq[c]
		r.Poisoned += got.total
		for _, id := range d.malformedIDs {
			if got.byID[id] == 1 && got.withReason[id] == 1 {
				dlqExact++
			}
		}
	}

	r.Lost = missingLines + (d.cfg.Orders - copiesCurrent)
	deliveredOnce := 0
	for _, c := range []*consumerRun{d.stock, d.shipping} {
		c.probe.mu.Lock()
		for _, id := range d.malformedIDs {
			if c.probe.perID[id] == 1 {
				deliveredOnce++
			}
		}
		c.probe.mu.Unlock()
	}
	r.rows = []checkRow{
		{"order lines reserved (rows, sku and quantity)", r.ExpectedReservations, r.ExpectedReservations - missingLines},
		{"reservation rows", r.ExpectedReservations, r.Reservations},
		{"duplicate reservations", 0, extraReservations},
		{"reservations for no order line", 0, strayReservations},
		{"SKUs whose reserved total matches the orders", skus, skus - skuMismatch},
		{"status copies at the order's latest version", d.cfg.Orders, copiesCurrent},
		{"events processed by stock (claims)", d.cfg.Orders, stockProcessed},
		{"events processed by shipping (claims)", r.Events, shipProcessed},
	}
	if d.cfg.Workers == 1 {
		r.rows = append(r.rows,
			checkRow{"malformed deliveries, once each per queue (never requeued)", r.ExpectedPoisoned, deliveredOnce},
			checkRow{"malformed messages once in each dead-letter queue, with reason", r.ExpectedPoisoned, dlqExact},
			checkRow{"dead-lettered messages", r.ExpectedPoisoned, r.Poisoned})
	} else {
		// A cut can also break another worker's ack right after its poison
		// publish: that message is delivered and dead-lettered again (the
		// dead-letter queue is at-least-once). Count distinct ids.
		r.rows = append(r.rows,
			checkRow{"malformed messages in each dead-letter queue", r.ExpectedPoisoned, distinctDLQ(dlq, d.malformedIDs)})
	}
	r.rows = append(r.rows,
		checkRow{"messages left in the consumer queues", 0, queued},
		checkRow{"outbox rows not relayed", 0, pending})
	r.OK = d.settled
	if !d.settled {
		r.reason = append(r.reason, fmt.Sprintf("the work did not settle within -timeout %s", d.cfg.Timeout))
	}
	for _, row := range r.rows {
		if !row.ok() {
			r.OK = false
			r.reason = append(r.reason, fmt.Sprintf("%s: expected %d, got %d", row.name, row.expected, row.actual))
		}
	}
	for _, c := range []struct {
		dst *counts
		run *consumerRun
	}{{&r.stock, d.stock}, {&r.ship, d.shipping}} {
		*c.dst = counts{
			deliveries:  c.run.probe.deliveries.Load(),
			redelivered: c.run.probe.redelivered.Load(),
			duplicates:  c.run.rec.duplicate.Load(),
			processed:   c.run.rec.processed.Load(),
			stale:       c.run.rec.stale.Load(),
		}
	}
	r.Deliveries = r.stock.deliveries + r.ship.deliveries
	r.Redelivered = r.stock.redelivered + r.ship.redelivered
	r.DuplicatesSkipped = r.stock.duplicates + r.ship.duplicates
	r.StaleSkipped = r.ship.stale
	r.ConnectionCuts = d.stock.probe.cuts.Load() + d.shipping.probe.cuts.Load()
	r.WallSeconds = float64(time.Since(d.started).Milliseconds()) / 1000
	return r, nil
}

func distinctDLQ(dlq map[string]dlqContent, ids []string) int {
	n := 0
	for _, got := range dlq {
		for _, id := range ids {
			if got.byID[id] > 0 {
				n++
			}
		}
	}
	return n
}

type dlqContent struct {
	total      int
	byID       map[string]int
	withReason map[string]int
}

// drainDeadLetters takes every message out of both dead-letter queues and
// counts them by AMQP message id, and those that carry the poison reason.
func (d *demo) drainDeadLetters() (map[string]dlqContent, error) {
	ch, err := d.amqpConn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	out := map[string]dlqContent{}
	for _, c := range []shop.Consumer{stock.Consumer, shipping.Consumer} {
		got := dlqContent{byID: map[string]int{}, withReason: map[string]int{}}
		for {
			m, ok, err := ch.Get(d.topo.DeadLetterQueue(c), true)
			if err != nil {
				return nil, err
			}
			if !ok {
				break
			}
			got.total++
			got.byID[m.MessageId]++
			if reason, _ := m.Headers[wmw.ReasonForPoisonedKey].(string); reason != "" {
				got.withReason[m.MessageId]++
			}
		}
		out[c.Name] = got
	}
	return out, nil
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\ndemo run %s (seed %d): %d orders, %d events, %d malformed messages\n", r.id, r.seed, r.Orders, r.Events, r.Malformed)
	fmt.Fprintf(w, "faults: relay republished %d rows, %d consumer connections cut before the ack, operator replayed %d events, %d status changes reordered\n\n",
		r.RelayRepublished, r.ConnectionCuts, r.Replayed, r.Reordered)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "check\texpected\tactual\t\t")
	for _, row := range r.rows {
		mark := "ok"
		if !row.ok() {
			mark = "FAIL"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t\n", row.name, row.expected, row.actual, mark)
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "deliveries\t%d\t(stock %d, shipping %d; %d flagged redelivered by the broker)\n", r.Deliveries, r.stock.deliveries, r.ship.deliveries, r.Redelivered)
	fmt.Fprintf(tw, "duplicates skipped by the claim\t%d\t(stock %d, shipping %d)\n", r.DuplicatesSkipped, r.stock.duplicates, r.ship.duplicates)
	fmt.Fprintf(tw, "stale status events skipped\t%d\t(acked, copy not written)\n", r.StaleSkipped)
	fmt.Fprintf(tw, "dead-lettered\t%d\t(malformed, never reached a handler)\n", r.Poisoned)
	fmt.Fprintf(tw, "lost effects\t%d\t\n", r.Lost)
	fmt.Fprintf(tw, "wall time\t%.1f s\t\n", r.WallSeconds)
	_ = tw.Flush()
	if len(r.reason) > 0 {
		fmt.Fprintf(w, "\nNOT OK:\n  %s\n", strings.Join(r.reason, "\n  "))
	}
	fmt.Fprintln(w)
	b, _ := json.Marshal(r)
	fmt.Fprintln(w, string(b))
}
