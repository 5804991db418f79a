package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/watermill-idempotency/idempotency/examples/billing"
	"github.com/watermill-idempotency/idempotency/examples/indexer"
	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/stock"
)

// result is the run's report; its JSON form is the last line of stdout.
type result struct {
	// Backend is the run's backend (-backend), first in the JSON line.
	Backend              string  `json:"backend"`
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
	Charges              int     `json:"charges"`
	ExpectedCharges      int     `json:"expected_charges"`
	Mails                int     `json:"mails"`
	ProviderTimeouts     int     `json:"provider_timeouts"`
	ChargesReconciled    int     `json:"charges_reconciled"`
	ReconcileRouted      int     `json:"reconcile_routed"`
	Products             int     `json:"products"`
	ProductUpdates       int     `json:"product_updates"`
	IndexLatest          int     `json:"index_latest"`
	IndexUpdates         int64   `json:"index_updates"`
	ObsoleteSkipped      int64   `json:"obsolete_skipped"`
	IndexStaleSkipped    int64   `json:"index_stale_skipped"`
	WallSeconds          float64 `json:"wall_seconds"`
	OK                   bool    `json:"ok"`

	id       string
	seed     uint64
	rows     []checkRow
	counts   []counts // per consumer, in d.consumers() order
	reason   []string
	replayed int  // order events; Replayed adds the catalogue's
	openTx   bool // a session held a write transaction open on the server all run
}

type counts struct {
	name                                                            string
	deliveries, redelivered, duplicates, processed, stale, obsolete int64
}

// checkRow is one verified invariant: expected and actual values.
type checkRow struct {
	name             string
	expected, actual int
}

func (r checkRow) ok() bool { return r.expected == r.actual }

// check verifies, from the databases, the fakes and the queues, after the
// shutdown: every order line reserved once (rows, quantities, per-SKU
// totals), every status copy at the order's version, every order charged
// once at the provider for its amount and recorded once in the ledger, one
// e-mail per charge, the index at every product's latest version, every
// event processed once by each consumer, every malformed message once in
// each dead-letter queue and nothing else there, nothing left in the queues
// or in the outboxes, nothing routed to reconciliation.
func (d *demo) check(ctx context.Context) (*result, error) {
	o, s, sh, b, ix := d.orderSchema, d.stock.schema, d.shipping.schema, d.billing.charge.schema, d.catalogue.indexer.schema
	bill, cat := d.billing, d.catalogue
	checks, err := d.newChecker(ctx)
	if err != nil {
		return nil, err
	}
	one := func(q string, args ...any) (int, error) { return checks.one(ctx, q, args...) }
	// sqlite picks the SQLite text of a check where it is not the
	// PostgreSQL text with ? placeholders.
	sqlite := func(pg, lite string) string {
		if d.embedded() {
			return lite
		}
		return pg
	}
	r := &result{
		Malformed:         len(d.malformedIDs),
		RelayRepublished:  d.flaky.republished.Load() + bill.flaky.republished.Load() + cat.flaky.republished.Load(),
		Replayed:          d.replayed + cat.replayed,
		replayed:          d.replayed,
		openTx:            d.cfg.OpenTx && !d.embedded(),
		Reordered:         d.reorder.reordered.Load() + cat.reorder.reordered.Load(),
		Charges:           bill.provider.Charges(),
		Mails:             bill.mailer.Count(),
		ChargesReconciled: bill.provider.Lookups(), // before the checks below look charges up
		Products:          d.cfg.Products,
		ProductUpdates:    int(cat.imported.Load()),
		id:                d.id,
		seed:              d.cfg.Seed,
	}
	if d.cfg.ProviderTimeoutEvery > 0 {
		r.ProviderTimeouts = r.Charges / d.cfg.ProviderTimeoutEvery // every n-th charge made timed out
	}
	queries := []struct {
		dst *int
		sql string
	}{
		{&r.Orders, `SELECT count(*) FROM ` + o + `.orders`},
		{&r.ExpectedReservations, `SELECT count(*) FROM ` + o + `.order_line`},
		{&r.Reservations, `SELECT count(*) FROM ` + s + `.reservation`},
		{&r.Events, `SELECT coalesce(sum(version), 0)::int FROM ` + o + `.orders`},
	}
	for _, q := range queries {
		if *q.dst, err = one(q.sql); err != nil {
			return nil, err
		}
	}
	r.ExpectedCharges = r.Orders
	missingLines, err := one(`SELECT count(*) FROM ` + o + `.order_line l WHERE NOT EXISTS (
		SELECT 1 FROM ` + s + `.reservation r WHERE r.order_id = l.order_id AND r.line_no = l.line_no AND r.sku = l.sku AND r.quantity = l.quantity)`)
	if err != nil {
		return nil, err
	}
	extraReservations, err := one(sqlite(`SELECT count(*) - count(DISTINCT (order_id, line_no)) FROM `+s+`.reservation`,
		`SELECT (SELECT count(*) FROM `+s+`.reservation) - (SELECT count(*) FROM (SELECT DISTINCT order_id, line_no FROM `+s+`.reservation))`))
	if err != nil {
		return nil, err
	}
	strayReservations, err := one(`SELECT count(*) FROM ` + s + `.reservation r WHERE NOT EXISTS (
		SELECT 1 FROM ` + o + `.order_line l WHERE r.order_id = l.order_id AND r.line_no = l.line_no)`)
	if err != nil {
		return nil, err
	}
	// SQLite keeps the quantities as REAL: sums compared at 3 decimals.
	skuMismatch, err := one(sqlite(`SELECT count(*) FROM (SELECT sku, sum(quantity) AS q FROM `+o+`.order_line GROUP BY sku) e
		FULL JOIN `+s+`.stock_level k USING (sku) WHERE e.q IS DISTINCT FROM k.reserved`,
		`SELECT count(*) FROM (SELECT sku, round(sum(quantity), 3) AS q FROM `+o+`.order_line GROUP BY sku) e
		FULL JOIN (SELECT sku, round(reserved, 3) AS r FROM `+s+`.stock_level) k USING (sku) WHERE e.q IS NOT k.r`))
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
	// A consumer's claims: its rows of the table and, where processed
	// migration 8 made it, of <table>_v7 (UUIDv7 events), once each.
	claims := func(schema, consumer string) (int, error) {
		v7 := 0
		if !d.embedded() {
			var err error
			if v7, err = one(`SELECT (to_regclass($1) IS NOT NULL)::int`, schema+".processed_event_v7"); err != nil {
				return 0, err
			}
		}
		if v7 == 0 {
			return one(`SELECT count(*) FROM `+schema+`.processed_event WHERE consumer = $1`, consumer)
		}
		return one(`SELECT count(*) FROM (SELECT event_id FROM `+schema+`.processed_event WHERE consumer = $1
			UNION SELECT v.event_id FROM `+schema+`.processed_event_v7 v JOIN `+schema+`.processed_event_consumer c ON c.id = v.consumer WHERE c.name = $1) x`, consumer)
	}
	stockProcessed, err := claims(s, stock.Consumer.Name)
	if err != nil {
		return nil, err
	}
	shipProcessed, err := claims(sh, shipping.Consumer.Name)
	if err != nil {
		return nil, err
	}
	billingProcessed, err := claims(b, billing.Consumer.Name)
	if err != nil {
		return nil, err
	}
	mailerProcessed, err := claims(b, billing.MailerConsumer.Name)
	if err != nil {
		return nil, err
	}
	indexerProcessed, err := claims(ix, indexer.Consumer.Name)
	if err != nil {
		return nil, err
	}

	// Billing: one ledger row per order, for the order's amount (Σ quantity
	// × unit price, rounded half up), naming the provider's charge for the
	// order's key with the same amount; one e-mail per order.
	ledgerRows, err := one(`SELECT count(*) FROM ` + b + `.billing_payment`)
	if err != nil {
		return nil, err
	}
	type payment struct {
		orderID, chargeID string
		amount            int64
	}
	var payments []payment
	err = checks.query(ctx, `SELECT p.order_id, p.charge_id, p.amount_minor FROM `+b+`.billing_payment p
		JOIN (SELECT order_id, sum(quantity) AS q FROM `+o+`.order_line GROUP BY order_id) l USING (order_id)
		WHERE p.amount_minor = round(l.q * $1) AND p.currency = $2`, []any{int64(billing.DefaultUnitPriceMinor), billing.DefaultCurrency},
		func(scan func(...any) error) error {
			var p payment
			if err := scan(&p.orderID, &p.chargeID, &p.amount); err != nil {
				return err
			}
			payments = append(payments, p)
			return nil
		})
	if err != nil {
		return nil, err
	}
	paymentsMatching := 0
	for _, p := range payments {
		key, err := billing.ChargeKey(p.orderID)
		if err != nil {
			return nil, err
		}
		c, ok, err := bill.provider.Lookup(ctx, key.String())
		if err != nil {
			return nil, err
		}
		if ok && c.ID == p.chargeID && c.AmountMinor == p.amount && c.Currency == billing.DefaultCurrency {
			paymentsMatching++
		}
	}
	mailedOrders := map[string]bool{}
	for _, m := range bill.mailer.Sent() {
		mailedOrders[m.Subject] = true
	}

	// Indexer: every product's document at the catalogue's version.
	want, err := cat.cat.Versions(ctx)
	if err != nil {
		return nil, err
	}
	for sku, v := range want {
		if doc, ok := cat.index.Get(sku); ok && doc.Version == v {
			r.IndexLatest++
		}
	}
	stats := cat.ix.Stats()
	r.IndexUpdates, r.ObsoleteSkipped, r.IndexStaleSkipped = stats.IndexUpdates, stats.ObsoleteSkipped, stats.StaleSkipped

	p, err := d.pending(ctx)
	if err != nil {
		return nil, err
	}
	queued, err := d.queued()
	if err != nil {
		return nil, err
	}
	if r.ReconcileRouted, err = d.reconcileQueued(); err != nil {
		return nil, err
	}
	dlq, err := d.drainDeadLetters()
	if err != nil {
		return nil, err
	}

	// Dead letters: each malformed message reaches each queue once, is
	// delivered once, and lands in the queue's dead-letter queue once, with
	// a reason. A delivery is repeated only when its ack did not reach the
	// broker: a lost connection (a cut), or on JetStream an AckWait that ran
	// out (the broker redelivers it, and it is dead-lettered again: the
	// dead-letter queue is at-least-once); never because it was requeued.
	// expected_poisoned counts those repeated deliveries too.
	deliveredOnce, dlqExact := 0, 0
	for _, c := range d.consumers() {
		per := d.malformedPerQueue(c.consumer)
		got := dlq[c.consumer.Name]
		r.Poisoned += got.total
		for _, id := range d.malformedIDs {
			n, explained := c.probe.malformedDeliveries(id)
			r.ExpectedPoisoned += max(n, per)
			if n >= per && n-per <= explained {
				deliveredOnce += per
			}
			if got.byID[id] == n && got.withReason[id] == n {
				dlqExact += per
			}
		}
	}
	malformedCopies := len(d.malformedIDs) * func() int {
		n := 0
		for _, c := range d.consumers() {
			n += d.malformedPerQueue(c.consumer)
		}
		return n
	}()

	r.Lost = missingLines + (r.Orders - copiesCurrent) + max(r.Orders-r.Charges, 0) + max(r.Orders-r.Mails, 0) + (len(want) - r.IndexLatest)
	r.rows = []checkRow{
		{"order lines reserved (rows, sku and quantity)", r.ExpectedReservations, r.ExpectedReservations - missingLines},
		{"reservation rows", r.ExpectedReservations, r.Reservations},
		{"duplicate reservations", 0, extraReservations},
		{"reservations for no order line", 0, strayReservations},
		{"SKUs whose reserved total matches the orders", skus, skus - skuMismatch},
		{"status copies at the order's latest version", r.Orders, copiesCurrent},
		{"orders charged at the provider (charges)", r.ExpectedCharges, r.Charges},
		{"ledger rows", r.Orders, ledgerRows},
		{"ledger rows for the order's amount and its provider charge", r.Orders, paymentsMatching},
		{"confirmation e-mails (mails = charges)", r.Charges, r.Mails},
		{"orders with a confirmation e-mail", r.Orders, len(mailedOrders)},
		{"uncertain charges routed to reconciliation", 0, r.ReconcileRouted},
		{"products indexed at their latest version", len(want), r.IndexLatest},
		{"index documents", len(want), cat.index.Len()},
		{"product updates indexed or skipped, once each", r.ProductUpdates, int(stats.IndexUpdates + stats.ObsoleteSkipped + stats.StaleSkipped)},
		{"events processed by stock (claims)", r.Orders, stockProcessed},
		{"events processed by shipping (claims)", r.Events, shipProcessed},
		{"events processed by billing (claims)", r.Orders, billingProcessed},
		{"confirmations processed by billing-mailer (claims)", r.Orders, mailerProcessed},
		{"product updates processed by indexer (claims)", r.ProductUpdates, indexerProcessed},
	}
	if d.cfg.Workers == 1 {
		r.rows = append(r.rows,
			checkRow{"malformed messages delivered once per queue (again only after a lost ack)", malformedCopies, deliveredOnce},
			checkRow{"malformed messages dead-lettered once per delivery, with reason", malformedCopies, dlqExact},
			checkRow{"dead-lettered messages", r.ExpectedPoisoned, r.Poisoned})
	} else {
		// A cut can also break another worker's ack right after its poison
		// publish, before the cut is counted: that message is delivered and
		// dead-lettered again. Count distinct ids.
		r.rows = append(r.rows,
			checkRow{"malformed messages in each dead-letter queue", malformedCopies, distinctDLQ(dlq, d.malformedIDs)})
	}
	r.rows = append(r.rows,
		checkRow{"messages left in the consumer queues", 0, queued},
		checkRow{"outbox rows not relayed (order, catalogue, billing)", 0, p.total()})
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
	if err := indexer.CheckLatest(cat.index, want); err != nil {
		r.OK = false
		r.reason = append(r.reason, err.Error())
	}
	for _, c := range d.consumers() {
		n := counts{
			name:        c.consumer.Name,
			deliveries:  c.probe.deliveries.Load(),
			redelivered: c.probe.redelivered.Load(),
			duplicates:  c.rec.duplicate.Load(),
			processed:   c.rec.processed.Load(),
			stale:       c.rec.stale.Load(),
			obsolete:    c.rec.obsolete.Load(),
		}
		r.counts = append(r.counts, n)
		r.Deliveries += n.deliveries
		r.Redelivered += n.redelivered
		r.DuplicatesSkipped += n.duplicates
		r.StaleSkipped += n.stale
		r.ConnectionCuts += c.probe.cuts.Load()
	}
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

// drainDeadLetters takes every message out of the dead-letter queues and
// counts them by AMQP message id, and those that carry the poison reason.
func (d *demo) drainDeadLetters() (map[string]dlqContent, error) {
	out := map[string]dlqContent{}
	for _, c := range d.consumers() {
		got, err := d.broker.drainDeadLetters(c.consumer)
		if err != nil {
			return nil, err
		}
		out[c.consumer.Name] = got
	}
	return out, nil
}

// reconcileQueued is the number of messages in the reconciliation queues.
func (d *demo) reconcileQueued() (int, error) {
	total := 0
	for _, c := range d.consumers() {
		if !c.consumer.Reconcile {
			continue
		}
		n, err := d.broker.reconciling(c.consumer)
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

func (r *result) print(w io.Writer) {
	fmt.Fprintf(w, "\ndemo run %s (seed %d): %d orders, %d order events, %d products × %d updates, %d malformed messages\n",
		r.id, r.seed, r.Orders, r.Events, r.Products, r.ProductUpdates/max(r.Products, 1), r.Malformed)
	fmt.Fprintf(w, "faults: relays republished %d rows, %d consumer connections cut before the ack, operator replayed %d events (%d order, %d catalogue), %d messages reordered, %d provider timeouts after charging\n\n",
		r.RelayRepublished, r.ConnectionCuts, r.Replayed, r.replayed, r.Replayed-r.replayed, r.Reordered, r.ProviderTimeouts)
	if r.openTx {
		fmt.Fprintf(w, "fault: a session in another database of the server held a write transaction open for the whole run; the relays did not wait for it\n\n")
	}
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
	per := func(f func(counts) int64) string {
		parts := make([]string, 0, len(r.counts))
		for _, c := range r.counts {
			if v := f(c); v > 0 {
				parts = append(parts, fmt.Sprintf("%s %d", c.name, v))
			}
		}
		return strings.Join(parts, ", ")
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "deliveries\t%d\t(%s; %d flagged redelivered by the broker)\n", r.Deliveries, per(func(c counts) int64 { return c.deliveries }), r.Redelivered)
	fmt.Fprintf(tw, "duplicates skipped by the claim\t%d\t(%s)\n", r.DuplicatesSkipped, per(func(c counts) int64 { return c.duplicates }))
	fmt.Fprintf(tw, "stale events skipped\t%d\t(%s; acked, not applied)\n", r.StaleSkipped, per(func(c counts) int64 { return c.stale }))
	fmt.Fprintf(tw, "charges\t%d\t(expected %d; %d provider timeouts reconciled by key, %d routed to reconciliation)\n", r.Charges, r.ExpectedCharges, r.ChargesReconciled, r.ReconcileRouted)
	fmt.Fprintf(tw, "mails\t%d\t(one per charge)\n", r.Mails)
	fmt.Fprintf(tw, "index updates\t%d\t(of %d product updates; %d obsolete and %d stale skipped)\n", r.IndexUpdates, r.ProductUpdates, r.ObsoleteSkipped, r.IndexStaleSkipped)
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
