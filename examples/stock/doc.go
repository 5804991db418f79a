// Package stock is a consumer of the example shop: for each placed order it
// reserves every order line once.
//
// The effect is deliberately not idempotent by itself: a reservation row per
// line (the table has no unique key on the line) and an increment of the
// SKU's reserved quantity. Run twice, it would reserve twice. The idempotent
// middleware runs Handle at most once per event_id with a committed effect:
// the claim of (consumer "stock", event_id) and the reservation commit in
// one transaction, so a redelivered, republished or replayed event is
// skipped. (A unique key on (order_id, line_no) would be good defence in
// depth in a real service; it would also hide the behaviour this example
// demonstrates.)
//
// Quantities arrive as decimal strings ("2.000") and are cast to numeric by
// PostgreSQL, never through a float.
package stock
