// Package marshaler defines the JSON envelope events travel in, the
// transport-neutral decoding every transport adapter uses ([Decoder],
// [DecodeMessage], [EncodeMessage]), the metadata keys it sets, and helpers
// for producers. It imports no transport client: the adapters are its leaf
// subpackages (marshaler/amqp for watermill-amqp v3, and one per other
// Watermill Pub/Sub), so a user of one transport links no other.
//
// The envelope:
//
//	{"event_id": "0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
//	 "event_name": "order.placed",
//	 "occurred_at": "2024-07-01T10:00:00.000Z",
//	 "payload": {"order_id": 42},
//	 "tenant": "acme"}
//
// event_id is the deduplication key of the whole library: the producer sets it
// once ([NewMessage] makes a UUIDv7) and every copy of the event carries it.
// On a Watermill message it is msg.UUID; event_name, occurred_at and any extra
// top-level fields are metadata (see the Metadata* keys).
//
// # Guaranteed
//
//   - An event id is accepted in any RFC 9562 text form (upper case, braces,
//     32 hex digits, urn:uuid:) and canonicalised (lower case, hyphenated)
//     before anything uses it; msg.UUID is always the canonical form. The nil
//     UUID is refused ([ErrNilEventID]).
//   - The payload travels byte for byte: it is never re-encoded, so number
//     spelling, key order and spacing inside it are kept. Extra top-level
//     fields survive a decode/encode round trip, as raw JSON.
//   - occurred_at is kept at full precision (nanoseconds) with its offset, and
//     the text received is written back unchanged (".000Z" stays ".000Z").
//   - [Envelope.Encode] is deterministic and [Decode] accepts what it writes.
//   - The envelope never alters the text it was given: a top-level key or a
//     string in event_id, event_name, occurred_at or an extra field that holds
//     bytes that are not UTF-8, or a lone UTF-16 surrogate escape ("\ud800"
//     alone), makes the envelope malformed, with the field named in the
//     reason; it is never replaced by U+FFFD (encoding/json's silent default).
//     The middleware parses msg.UUID with the same rules ([ParseEventID]).
//   - [Decoder.Decode] (and every adapter's Unmarshal) never returns an error
//     and never panics: most Watermill subscribers nack or stop on an
//     Unmarshal error (watermill-amqp requeues it in a hot loop,
//     watermill-nats leaves it unacked for redelivery every AckWait), so one
//     bad message would loop forever. A body that is not a valid envelope
//     becomes a message flagged with [MetadataMalformed], its raw body as
//     payload, its reason in [MetadataMalformedReason]; [EncodeMessage]
//     gives such a message's raw body unchanged for the dead-letter topic.
//   - Headers cannot set the metadata this package derives from the delivery
//     ([ReservedKey]: a sender cannot flag, unflag or rename a message, or
//     fake its delivery count).
//   - [EncodeMessage] never gives a body without a valid event id.
//
// # Not guaranteed
//
//   - Whitespace around the payload value (outside it) is not kept: it is not
//     part of the value. Whitespace and escapes elsewhere in the envelope, and
//     the order of its top-level keys, are not kept either.
//   - Decoding checks the envelope, not the payload's schema: any JSON value,
//     null included, is a payload. The payload's text is not checked for
//     valid UTF-8 either: it is passed on byte for byte and the handler's
//     decoder sees exactly what was sent.
//   - A flagged (malformed) message's UUID is the delivery's message-id or a
//     random one: it identifies nothing and must not be used to deduplicate.
//   - Transport timestamps (the AMQP timestamp property holds whole seconds)
//     are not the event's time; the envelope's occurred_at is.
//   - Nothing here deduplicates: that is the middleware's job, keyed on the
//     event id this package guarantees.
package marshaler
