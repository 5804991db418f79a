// Package order is the producer of the example shop: it places orders and
// changes their status, and publishes events through a transactional outbox.
//
// # The outbox
//
// PlaceOrder and ChangeStatus write the order rows and the event in one pgx
// transaction. The event is a Watermill message built by
// marshaler.NewMessage (its UUID, the event_id, is a UUIDv7 fixed here, when
// the outbox row is written, and never again). It is "published" with a
// watermill-sql v4 publisher on that same transaction (sql.TxFromPgx), wrapped
// by Watermill's forwarder publisher (forwarder.NewPublisher): the outbox row
// is the forwarder's JSON envelope {destination_topic, uuid, payload,
// metadata} in the table "watermill_<OutboxTopic>", so it commits or rolls
// back with the order.
//
// The Relay is Watermill's forwarder (forwarder.NewForwarder) reading that
// table with the watermill-sql v4 subscriber and publishing each message to
// the events exchange with amqpmarshaler.Marshaler. The forwarder envelope keeps
// msg.UUID, payload and metadata unchanged, so the AMQP envelope carries the
// event_id set at write time.
//
// # Guarantees and windows
//
//   - No event is lost: the row commits with the order, and the relay's read
//     position (the offsets table) only moves after the broker confirmed the
//     publish (publisher confirms) and the subscriber's transaction commits.
//   - No event is skipped: the watermill-sql v4 subscriber only reads rows of
//     transactions older than the oldest transaction still running on the
//     server (pg_snapshot_xmin), so a row that commits late behind a row that
//     committed early is still read. The price: the relay waits behind the
//     oldest open write transaction of the whole PostgreSQL cluster.
//   - Events are republished: a relay that crashes (or fails to store its
//     position) after the broker confirmed publishes again, with the same
//     event_id, up to a batch (RelayConfig.BatchSize) of rows. Replay
//     republishes on purpose. Consumers deduplicate by event_id: that is the
//     idempotent middleware's job.
//   - Order: rows are published in commit order of their transactions, one
//     at a time, by one relay at a time (the offsets row is locked). Replays,
//     republished batches and broker redeliveries break that order at the
//     consumer; state copies must be versioned (see examples/shipping).
package order
