// Package order is the producer of the example shop: it places orders and
// changes their status, and publishes events through a transactional outbox.
//
// # The outbox
//
// PlaceOrder and ChangeStatus write the order rows and the event in one
// transaction. The event is a Watermill message built by
// marshaler.NewMessage (its UUID, the event_id, is a UUIDv7 fixed here, when
// the outbox row is written, and never again). It is written with the
// library outbox's publisher (outbox.Outbox.Publisher) on that same
// transaction: one row (event_id, topic, payload, metadata) in the table
// OutboxTopic, committed or rolled back with the order.
//
// The Relay is the library relay (outbox.Relay): it claims committed rows in
// id order, publishes each to the events exchange with amqpmarshaler.Marshaler, and
// deletes it (keeping a copy for RelayConfig.Retention, for Replay) in the
// same transaction.
//
// # Guarantees and windows
//
//   - No event is lost: the row commits with the order, and it leaves the
//     outbox only in the relay transaction that follows the broker's confirm.
//   - No event is skipped: the relay keeps no read position; a row that
//     commits late is claimed by a later round. No open transaction anywhere
//     on the server holds the relay back (see package outbox).
//   - Events are republished: a relay that crashes after the broker
//     confirmed publishes again, with the same event_id, up to a batch
//     (RelayConfig.BatchSize) of rows. Replay republishes on purpose.
//     Consumers deduplicate by event_id: that is the consumer's claim
//     (middleware.NewConsumer).
//   - Order: one relay publishes at a time (the outbox's lock row), rows in
//     id order; a row whose publish failed holds back the rows of its topic
//     until it is published or dead-lettered. Replays, republished batches and broker redeliveries break order
//     at the consumer too; state copies must be versioned (see
//     examples/shipping).
package order
