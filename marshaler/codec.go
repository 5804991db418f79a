package marshaler

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/wire"
)

// This file is the transport-neutral half of every adapter (marshaler/amqp,
// marshaler/jetstream, marshaler/redisstream, marshaler/kafka): turning a
// received body into a message without ever failing, and a message into the
// body to publish. An adapter adds only what its transport owns: where the
// body, the headers, the message id and the delivery count live.

// Decoder turns received bodies into Watermill messages and never fails: a
// body that is not an envelope becomes a message flagged with
// [MetadataMalformed], for the middleware to dead-letter once. The zero value
// is ready to use (limit [DefaultMaxSize]).
//
// Every transport adapter of this module decodes with a Decoder, so the rules
// below hold on every transport.
type Decoder struct {
	// MaxSize is the largest body in bytes; a larger one is flagged
	// malformed. 0 or less means [DefaultMaxSize].
	MaxSize int

	// ClaimKey, when set, derives the event id (the claim key) of a
	// CloudEvent whose id is not a UUID; [UUIDv5ClaimKey] is the usual
	// choice, and its doc says the trade-offs. Nil (the default) flags such
	// an event malformed. An error or the nil UUID flags it malformed too.
	// It is called only for events from producers that are not ours: an
	// envelope always carries a UUID.
	ClaimKey func(ForeignID) (uuid.UUID, error)
}

// DecodeMessage is Decoder{MaxSize: maxSize}.Decode(body, transportID): the
// never-failing decoding entry point of the adapters. See [Decoder.Decode].
func DecodeMessage(body []byte, maxSize int, transportID string) *message.Message {
	return Decoder{MaxSize: maxSize}.Decode(body, transportID)
}

// Decode turns one received body into a message. It never returns nil and
// never panics.
//
// A body that [Decode] accepts, or a structured CloudEvent (see
// [ForeignID] and the CloudEvents notes in cloudevents.go), gives msg.UUID = the canonical event_id
// (transportID is ignored: a broker's message id identifies a delivery or a
// publish, not the event), msg.Payload = the payload bytes as received (a
// copy), and metadata [MetadataEventName], [MetadataOccurredAt] and the
// [MetadataExtraPrefix] keys from the envelope.
//
// Any other body gives [NewMalformed](body, transportID, reason), reason being
// the [DecodeError] text.
//
// Decode sets no transport metadata: the adapter copies the headers it
// received (skipping every key [ReservedKey] reports) and then sets
// [MetadataRedelivered] and [MetadataDeliveryCount] with [SetRedelivered] and
// [SetDeliveryCount].
func (d Decoder) Decode(body []byte, transportID string) (msg *message.Message) {
	defer func() {
		// Belt and braces: a panic would kill the subscriber, an error would
		// loop; a flagged message is the one safe outcome.
		if r := recover(); r != nil {
			msg = NewMalformed(body, transportID, fmt.Sprintf("marshaler: internal error decoding the body: %v", r))
		}
	}()
	return d.decode(body, transportID, nil)
}

// decode tries the envelope, then a structured CloudEvent, then (with
// headers) a binary CloudEvent; anything else is flagged with the envelope's
// refusal.
func (d Decoder) decode(body []byte, transportID string, headers map[string]string) *message.Message {
	limit := d.MaxSize
	if limit <= 0 {
		limit = DefaultMaxSize
	}
	env, err := Decode(body, limit)
	if err == nil {
		return FromEnvelope(env)
	}
	if len(body) > limit {
		return NewMalformed(body, transportID, err.Error())
	}
	if ce, ok, cerr := d.structuredCloudEvent(body); ok {
		if cerr != nil {
			return NewMalformed(body, transportID, cerr.Error())
		}
		return FromEnvelope(ce)
	}
	if headers != nil {
		if ce, ok, cerr := d.binaryCloudEvent(body, headers); ok {
			if cerr != nil {
				return NewMalformed(body, transportID, cerr.Error())
			}
			return FromEnvelope(ce)
		}
	}
	return NewMalformed(body, transportID, err.Error())
}

// malformedNamespace is the UUID namespace of the ids NewMalformed derives
// from a malformed body when the transport gave none.
var malformedNamespace = uuid.MustParse("6f1c2a4e-3b7d-5e8f-9a0b-1c2d3e4f5a6b")

// NewMalformed returns a message flagged malformed: Payload = a copy of body,
// unchanged, [MetadataMalformed] = "true", [MetadataMalformedReason] = reason,
// msg.UUID = transportID, or when it is empty a name-based UUID (version 5,
// RFC 9562 §5.5) of body in malformedNamespace, so that every redelivery of
// one malformed body carries the same id in logs and on the poison topic.
// That UUID is not an event id and must not be used to deduplicate; the
// middleware never claims a flagged message, it rejects it as permanent
// (dead-letter once).
//
// Adapters call it when something other than the body is unusable, for
// example a record they cannot read at all.
func NewMalformed(body []byte, transportID, reason string) *message.Message {
	if transportID == "" {
		transportID = uuid.NewSHA1(malformedNamespace, body).String()
	}
	msg := message.NewMessage(transportID, append(message.Payload(nil), body...))
	msg.Metadata.Set(MetadataMalformed, "true")
	msg.Metadata.Set(MetadataMalformedReason, reason)
	return msg
}

// ReservedKey reports whether key is metadata this package derives on
// reception ([MetadataEventName], [MetadataOccurredAt], [MetadataMalformed],
// [MetadataMalformedReason], [MetadataRedelivered], [MetadataDeliveryCount],
// any [MetadataExtraPrefix] key), the envelope header [EncodeMessage]
// adds ("idempotency_envelope") and the marks adapters set on a delivery
// for the consumer's crash bound ("idempotency_uncounted_delivery",
// "idempotency_position"). An adapter must not let an incoming header
// of that name set it: a sender could otherwise flag, unflag or rename a
// message, or fake its delivery count. Keys are compared exactly.
func ReservedKey(key string) bool {
	switch key {
	case MetadataEventName, MetadataOccurredAt, MetadataMalformed, MetadataMalformedReason, wire.EnvelopeHeader:
		return true
	}
	return wire.DeliveryScoped(key) || strings.HasPrefix(key, MetadataExtraPrefix)
}

// SetRedelivered sets [MetadataRedelivered] to "true" or "false".
func SetRedelivered(msg *message.Message, redelivered bool) {
	msg.Metadata.Set(MetadataRedelivered, strconv.FormatBool(redelivered))
}

// SetDeliveryCount sets [MetadataDeliveryCount] to n, the number of earlier
// deliveries of this message (0 on the first delivery). A negative n removes
// the key (unknown).
func SetDeliveryCount(msg *message.Message, n int64) {
	if n < 0 {
		delete(msg.Metadata, MetadataDeliveryCount)
		return
	}
	msg.Metadata.Set(MetadataDeliveryCount, strconv.FormatInt(n, 10))
}

// EncodeMessage returns the body and the headers to publish msg with, for an
// adapter. maxSize is the largest body in bytes (0 or less: [DefaultMaxSize]).
//
// For an ordinary message the body is the envelope of [ToEnvelope] written by
// [Envelope.Encode], and the headers are the metadata except the
// [MetadataExtraPrefix] keys (they are in the body) and the keys that
// describe the delivery received, not the message ([MetadataRedelivered],
// [MetadataDeliveryCount] and the crash bound's marks), plus the header
// "idempotency_envelope: 1", which says the body is an envelope: an adapter
// drops it on reception ([ReservedKey]); a subscriber that does not decode
// the envelope (Watermill's default unmarshaler) keeps it, and the consumer
// holds such a message as a configuration error instead of running the
// handler on the envelope. It returns an error when
// msg has no valid envelope (in particular no valid event id: nothing is ever
// published without one) or the body exceeds maxSize.
//
// A message flagged malformed ([Malformed]) is on its way to a dead-letter
// (poison) topic: the body is its Payload, the raw bytes received, verbatim,
// and the headers are its metadata (the reason included) but the keys of
// the delivery received. Nothing is
// validated and this path never fails, so the dead-letter destination gets
// the original bytes.
//
// The adapter drops the headers its transport owns or cannot carry.
func EncodeMessage(msg *message.Message, maxSize int) (body []byte, headers map[string]string, err error) {
	if msg == nil {
		return nil, nil, errors.New("marshaler: nil message")
	}
	if _, malformed := Malformed(msg); malformed {
		headers = make(map[string]string, len(msg.Metadata))
		for k, v := range msg.Metadata {
			if !wire.DeliveryScoped(k) {
				headers[k] = v
			}
		}
		return msg.Payload, headers, nil
	}
	env, err := ToEnvelope(msg)
	if err != nil {
		return nil, nil, err
	}
	body, err = env.Encode()
	if err != nil {
		return nil, nil, fmt.Errorf("marshaler: %w", err)
	}
	if maxSize <= 0 {
		maxSize = DefaultMaxSize
	}
	if len(body) > maxSize {
		return nil, nil, fmt.Errorf("marshaler: envelope is %d bytes, over the limit of %d bytes", len(body), maxSize)
	}
	headers = make(map[string]string, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		if !strings.HasPrefix(k, MetadataExtraPrefix) && !wire.DeliveryScoped(k) {
			headers[k] = v
		}
	}
	headers[wire.EnvelopeHeader] = "1"
	return body, headers, nil
}

// Delivery is what an adapter read from its transport, in neutral form, for
// [Decoder.DecodeDelivery].
type Delivery struct {
	// Body is the message body as received.
	Body []byte
	// Headers are the transport's headers as text (the adapter renders
	// non-text values). Keys [ReservedKey] reports are ignored.
	Headers map[string]string
	// TransportID is the transport's id of the message (a message-id header,
	// a Watermill UUID header, a record coordinate), used only as the UUID of
	// a message flagged malformed. May be empty.
	TransportID string
}

// DecodeDelivery is [Decoder.Decode] of in.Body, where a binary-mode
// CloudEvent (ce-id, ce-type, ce-source, ce-specversion, ce-time headers) is
// accepted too, followed by the copy of every header that [ReservedKey] does
// not report into the metadata. It never returns nil and never panics.
func (d Decoder) DecodeDelivery(in Delivery) (msg *message.Message) {
	defer func() {
		if r := recover(); r != nil {
			msg = NewMalformed(in.Body, in.TransportID, fmt.Sprintf("marshaler: internal error decoding the delivery: %v", r))
		}
	}()
	headers := in.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	msg = d.decode(in.Body, in.TransportID, headers)
	for k, v := range in.Headers {
		if !ReservedKey(k) {
			msg.Metadata.Set(k, v)
		}
	}
	return msg
}
