package marshaler

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys this package reads and writes on a Watermill message. The
// event id is not among them: it is msg.UUID, in canonical form.
//
// On reception (every adapter decodes with [Decoder]) the values of these keys
// are derived from the delivery itself; incoming headers with the same names
// are dropped ([ReservedKey]), so a sender cannot flag or unflag a message or
// fake its event name or delivery count. The keys are the same on every
// transport. [MetadataRedelivered] and [MetadataDeliveryCount] describe the
// delivery received: [EncodeMessage] leaves them out of what it sends on.
const (
	// MetadataEventName holds the envelope's event_name, for example
	// "order.placed". Set by [NewMessage], [FromEnvelope] and on reception;
	// absent on a malformed delivery.
	MetadataEventName = "event_name"

	// MetadataOccurredAt holds the envelope's occurred_at as RFC 3339 text
	// (the text received, or time.RFC3339Nano for messages built here). Read
	// it with [OccurredAt]. Absent on a malformed delivery.
	MetadataOccurredAt = "occurred_at"

	// MetadataMalformed is "true" on a message whose delivery could not be
	// decoded as an envelope (see [Decoder.Decode]); its Payload is then the
	// raw delivery body and its UUID is not an event id. Absent otherwise.
	// Read it with [Malformed]. Such a message must never reach a handler: it
	// is a permanent failure, for the dead-letter (poison) topic.
	MetadataMalformed = "idempotency_malformed"

	// MetadataMalformedReason holds why a malformed delivery was refused: the
	// [DecodeError] text, for example "envelope: event_id: not a UUID (10
	// characters)". Set only together with [MetadataMalformed].
	MetadataMalformedReason = "idempotency_malformed_reason"

	// MetadataRedelivered is "true" when the transport reports that the
	// message was delivered before (it may have been seen, though not
	// necessarily processed, by a consumer), else "false"; absent when the
	// transport cannot tell. Each adapter says where it comes from: AMQP the
	// basic.deliver redelivered bit, JetStream NumDelivered > 1, Redis
	// Streams a delivery count above 1 in the consumer group's pending list,
	// Kafka never (it has no such flag). Read it with [Redelivered].
	MetadataRedelivered = "redelivered"

	// MetadataDeliveryCount holds, in decimal, how many times the message was
	// delivered before this delivery (0 on the first one), as the transport
	// counts: AMQP the x-delivery-count header of quorum queues, JetStream
	// NumDelivered - 1, Redis Streams the pending list's delivery count - 1.
	// Absent when unknown (AMQP classic queues, Kafka, first delivery on some
	// RabbitMQ versions). Read it with [DeliveryCount].
	MetadataDeliveryCount = "delivery_count"

	// MetadataExtraPrefix prefixes one metadata key per extra top-level
	// envelope field ([Envelope.Extra]): the field "tenant" is carried as the
	// key "envelope.tenant", its value the field's raw JSON text (a string
	// field keeps its quotes: `"acme"`). [ToEnvelope] turns these keys back
	// into extra fields, so each value must be valid JSON.
	MetadataExtraPrefix = "envelope."
)

// Malformed reports whether msg was flagged as malformed on reception
// ([MetadataMalformed] is "true"), and why ([MetadataMalformedReason]).
// A nil msg is not malformed.
func Malformed(msg *message.Message) (reason string, ok bool) {
	if msg == nil || msg.Metadata.Get(MetadataMalformed) != "true" {
		return "", false
	}
	return msg.Metadata.Get(MetadataMalformedReason), true
}

// EventName returns the message's event name ([MetadataEventName]), or "" when
// it has none (a malformed delivery, a message not built by this package) or
// msg is nil.
func EventName(msg *message.Message) string {
	if msg == nil {
		return ""
	}
	return msg.Metadata.Get(MetadataEventName)
}

// OccurredAt parses the message's [MetadataOccurredAt] as an RFC 3339
// date-time (RFC 3339 section 5.6; any number of fractional digits, kept to
// the nanosecond; any offset, kept; "T" and "Z" in either case). It returns an
// error when the key is absent or its value is not such a time.
func OccurredAt(msg *message.Message) (time.Time, error) {
	if msg == nil {
		return time.Time{}, errors.New("marshaler: nil message")
	}
	s, ok := msg.Metadata[MetadataOccurredAt]
	if !ok || s == "" {
		return time.Time{}, fmt.Errorf("marshaler: metadata %s: missing", MetadataOccurredAt)
	}
	t, err := parseRFC3339(s)
	if err != nil {
		return time.Time{}, fmt.Errorf("marshaler: metadata %s: %w", MetadataOccurredAt, err)
	}
	return t, nil
}

// Redelivered reports whether [MetadataRedelivered] is "true".
func Redelivered(msg *message.Message) bool {
	return msg != nil && msg.Metadata.Get(MetadataRedelivered) == "true"
}

// DeliveryCount returns [MetadataDeliveryCount] as a number, and false when it
// is absent or not a non-negative decimal integer.
func DeliveryCount(msg *message.Message) (int64, bool) {
	if msg == nil {
		return 0, false
	}
	s, ok := msg.Metadata[MetadataDeliveryCount]
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}
