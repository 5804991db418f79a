// Package shipping is a consumer of the example shop: it keeps a copy of
// each order's status, for its own use, with the versioned upsert.
//
// Events can arrive out of order (a republished batch, a replay, a
// redelivery that overtakes a later event, two consumers). The order service
// publishes the order's version with every event (1 when placed, then +1 per
// status change, incremented in the transaction that writes the outbox row),
// and the copy only moves forward: a version not greater than the stored one
// is Stale, acknowledged and recorded as processed, never written.
//
// Two layers, two jobs: the consumer's claim skips an event_id already
// processed (a duplicate never reaches Handle); the versioned upsert orders
// distinct events (an older event, processed for the first time, does not
// overwrite a newer state).
package shipping
