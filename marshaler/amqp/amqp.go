// Package amqp is the watermill-amqp v3 adapter of the envelope: a
// [wamqp.Marshaler] that publishes messages in the JSON envelope of package
// marshaler and decodes deliveries with [marshaler.Decoder], so it never
// fails on foreign or malformed input.
//
// Set Marshaler{} as the Marshaler of the publisher's and the subscriber's
// amqp.Config. Deduplication notes for RabbitMQ:
//
//   - RabbitMQ does not deduplicate: a publisher retry after a lost confirm,
//     an outbox relay republish and a redelivery after a lost ack (connection
//     cut, consumer crash before the ack) all reach the consumer again. The
//     event id in the body, never the AMQP message-id or delivery tag, is
//     what the middleware claims.
//   - redelivered (basic.deliver) is a hint: true means the message may have
//     been seen before, not that it was processed. Quorum queues also count
//     deliveries in x-delivery-count, mapped to [marshaler.MetadataDeliveryCount];
//     their delivery-limit dead-letters a message after that many nacks, so
//     infrastructure failures must not nack (the middleware does not).
package amqp

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Marshaler is the [wamqp.Marshaler] for watermill-amqp v3 that puts messages
// in the JSON envelope (see [marshaler.Envelope]). The zero value is ready to
// use; set it as the Marshaler of the publisher's and the subscriber's
// amqp.Config.
//
// Unmarshal returns an error only for the zero Delivery, which is no
// message (see errNoDelivery): watermill-amqp nacks a delivery *with
// requeue* when Unmarshal fails, so one undecodable message would loop hot
// forever. A delivery that is not a valid envelope becomes a message flagged
// with [marshaler.MetadataMalformed] instead, for the middleware to
// dead-letter.
type Marshaler struct {
	// MaxSize is the largest body in bytes: a larger delivery is flagged
	// malformed, and Marshal refuses to publish a larger envelope (the
	// consumers would refuse it). 0 or less means [marshaler.DefaultMaxSize].
	MaxSize int
	// NotPersistent publishes with delivery mode transient (1) instead of
	// persistent (2), which the default is. Persistent messages in a durable
	// queue survive a broker restart.
	NotPersistent bool
	// ClaimKey is [marshaler.Decoder.ClaimKey]: it derives the claim key of
	// a CloudEvent whose id is not a UUID. Nil flags such an event malformed.
	ClaimKey func(marshaler.ForeignID) (uuid.UUID, error)
}

var _ wamqp.Marshaler = Marshaler{}

// maxShortstr is the longest AMQP short string (table keys, message-id,
// type). Recent amqp091 versions fail the publish on a longer one; older ones
// silently truncated it.
const maxShortstr = 255

// headerDeliveryCount is the header RabbitMQ quorum queues count deliveries in.
const headerDeliveryCount = "x-delivery-count"

// Marshal turns msg into an AMQP publishing.
//
// For an ordinary message the body and headers are those of
// [marshaler.EncodeMessage]; MessageId is the canonical event id, Type the
// event name (left empty when longer than 255 bytes, the AMQP limit),
// Timestamp occurred_at (AMQP keeps whole seconds), ContentType
// "application/json", DeliveryMode persistent unless NotPersistent. The
// headers RabbitMQ owns (x-death, x-delivery-count, x-first-death-*,
// x-last-death-*) are not ours to send and are dropped. It returns an error
// when msg has no valid envelope (in particular no valid event id), when the
// body exceeds MaxSize, or when a metadata key is longer than 255 bytes.
//
// A message flagged malformed ([marshaler.Malformed]) is on its way to a
// dead-letter (poison) topic: its Payload, the raw body received, is
// published verbatim, with its metadata (reason included) as headers and
// msg.UUID as MessageId (when at most 255 bytes). Nothing is validated and
// over-long header keys are dropped, so the dead-letter queue gets the
// original bytes; this path never fails.
func (m Marshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	body, meta, err := marshaler.EncodeMessage(msg, m.MaxSize)
	if err != nil {
		return amqp091.Publishing{}, err
	}
	mode := amqp091.Persistent
	if m.NotPersistent {
		mode = amqp091.Transient
	}

	if _, malformed := marshaler.Malformed(msg); malformed {
		headers := make(amqp091.Table, len(meta))
		for k, v := range meta {
			if len(k) <= maxShortstr && !brokerHeader(k) {
				headers[k] = v
			}
		}
		pub := amqp091.Publishing{Headers: headers, DeliveryMode: mode, Body: body}
		if len(msg.UUID) <= maxShortstr {
			pub.MessageId = msg.UUID
		}
		return pub, nil
	}

	headers := make(amqp091.Table, len(meta))
	for k, v := range meta {
		if brokerHeader(k) {
			continue
		}
		if len(k) > maxShortstr {
			return amqp091.Publishing{}, fmt.Errorf("marshaler: metadata key of %d bytes, over the AMQP limit of %d", len(k), maxShortstr)
		}
		headers[k] = v
	}
	// EncodeMessage validated the envelope: the id and the time parse.
	id, _ := marshaler.ParseEventID(msg.UUID)
	at, _ := marshaler.OccurredAt(msg)
	pub := amqp091.Publishing{
		Headers:      headers,
		ContentType:  "application/json",
		DeliveryMode: mode,
		MessageId:    id.String(),
		Timestamp:    at,
		Body:         body,
	}
	if name := marshaler.EventName(msg); len(name) <= maxShortstr {
		pub.Type = name
	}
	return pub, nil
}

// brokerHeader reports whether RabbitMQ sets the header itself.
func brokerHeader(k string) bool {
	return k == "x-death" || k == headerDeliveryCount ||
		strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")
}

// Unmarshal turns a delivery into a message. It returns an error only for
// the zero Delivery, which a closed delivery channel gives (see
// [Marshaler]).
//
// The body and headers are decoded by [marshaler.Decoder.DecodeDelivery]
// (the envelope, or a CloudEvent in structured mode or in binary mode with
// cloudEvents:* / cloudEvents_* headers) with the delivery's MessageId as the
// transport id: a valid envelope gives msg.UUID = the
// canonical event_id (the MessageId is ignored), anything else a message
// flagged malformed whose UUID is the MessageId or a random id.
//
// In both cases every header becomes metadata text: strings as they are,
// []byte as its bytes, numbers and booleans in Go's decimal notation,
// time.Time as RFC 3339 with nanoseconds in UTC, amqp091.Decimal as a decimal
// number, arrays and tables (x-death is an array of tables) as JSON, a void
// value as "". Headers named like the keys the marshaler derives
// ([marshaler.ReservedKey]) are dropped: the delivery decides those. Then
// [marshaler.MetadataRedelivered] is set from the delivery's redelivered flag
// and [marshaler.MetadataDeliveryCount] from an integer x-delivery-count
// header.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (msg *message.Message, _ error) {
	if noDelivery(d) {
		return nil, errNoDelivery
	}
	defer func() {
		// Belt and braces: a panic here would kill the subscriber, and an
		// error would loop; a flagged message is the one safe outcome.
		if r := recover(); r != nil {
			msg = marshaler.NewMalformed(d.Body, d.MessageId, fmt.Sprintf("marshaler: internal error decoding the delivery: %v", r))
			marshaler.SetRedelivered(msg, d.Redelivered)
		}
	}()

	in := marshaler.Delivery{Body: d.Body, Headers: make(map[string]string, len(d.Headers)), TransportID: d.MessageId}
	for k, v := range d.Headers {
		in.Headers[k] = headerText(v)
	}
	msg = marshaler.Decoder{MaxSize: m.MaxSize, ClaimKey: m.ClaimKey}.DecodeDelivery(in)
	marshaler.SetRedelivered(msg, d.Redelivered)
	if n, ok := deliveryCount(d.Headers[headerDeliveryCount]); ok {
		msg.Metadata.Set(marshaler.MetadataDeliveryCount, n)
	}
	return msg, nil
}

// errNoDelivery is Unmarshal's one error: the zero Delivery, which
// watermill-amqp v3 reads from a delivery channel amqp091-go closed (the
// broker cancelled the consumer: basic.cancel, its queue deleted) and is no
// message. Flagged malformed it would be dead-lettered as an empty phantom
// (and `idem dlq redrive` would publish it to the queue); failing, its nack
// fails too and watermill-amqp opens a new channel and consumes again.
var errNoDelivery = errors.New("amqp: the zero delivery of a closed delivery channel (the broker cancelled the consumer), not a message")

// noDelivery reports whether d is the zero Delivery: no acknowledger, no
// delivery tag (a broker's start at 1), no body, header, id or routing.
func noDelivery(d amqp091.Delivery) bool {
	return d.Acknowledger == nil && d.DeliveryTag == 0 && d.Body == nil && d.Headers == nil &&
		d.MessageId == "" && d.ConsumerTag == "" && d.Exchange == "" && d.RoutingKey == ""
}

// deliveryCount returns v as decimal text when it is a non-negative integer.
func deliveryCount(v any) (string, bool) {
	var n int64
	switch v := v.(type) {
	case int8:
		n = int64(v)
	case int16:
		n = int64(v)
	case int32:
		n = int64(v)
	case int64:
		n = v
	case int:
		n = int64(v)
	case uint8:
		n = int64(v)
	case uint16:
		n = int64(v)
	case uint32:
		n = int64(v)
	case uint64:
		return strconv.FormatUint(v, 10), true
	case uint:
		return strconv.FormatUint(uint64(v), 10), true
	default:
		return "", false
	}
	if n < 0 {
		return "", false
	}
	return strconv.FormatInt(n, 10), true
}

// headerText renders one header value as metadata text; it never fails.
func headerText(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	case []any, amqp091.Table, map[string]any:
		b, err := json.Marshal(jsonValue(v, 0))
		if err != nil {
			return fmt.Sprintf("%T", v)
		}
		return string(b)
	}
	if s, ok := scalarText(v); ok {
		return s
	}
	return fmt.Sprint(v)
}

// scalarText renders the scalar AMQP field types.
func scalarText(v any) (string, bool) {
	switch v := v.(type) {
	case bool:
		return strconv.FormatBool(v), true
	case int8:
		return strconv.FormatInt(int64(v), 10), true
	case int16:
		return strconv.FormatInt(int64(v), 10), true
	case int32:
		return strconv.FormatInt(int64(v), 10), true
	case int64:
		return strconv.FormatInt(v, 10), true
	case int:
		return strconv.FormatInt(int64(v), 10), true
	case uint8:
		return strconv.FormatUint(uint64(v), 10), true
	case uint16:
		return strconv.FormatUint(uint64(v), 10), true
	case uint32:
		return strconv.FormatUint(uint64(v), 10), true
	case uint64:
		return strconv.FormatUint(v, 10), true
	case uint:
		return strconv.FormatUint(uint64(v), 10), true
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32), true
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), true
	case amqp091.Decimal:
		return decimalText(v), true
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano), true
	}
	return "", false
}

// maxHeaderDepth bounds the nesting rendered as JSON; a table from the wire
// cannot be cyclic, but a hand-built one can.
const maxHeaderDepth = 32

// jsonValue converts an AMQP field value to one json.Marshal renders without
// error: tables become objects, arrays arrays, []byte and times strings,
// numbers numbers (non-finite floats as strings).
func jsonValue(v any, depth int) any {
	if depth > maxHeaderDepth {
		return "(nested too deep)"
	}
	switch v := v.(type) {
	case nil, string, bool, int8, int16, int32, int64, int, uint8, uint16, uint32, uint64, uint:
		return v
	case []byte:
		return string(v)
	case float32:
		if f := float64(v); math.IsNaN(f) || math.IsInf(f, 0) {
			return strconv.FormatFloat(f, 'g', -1, 32)
		}
		return v
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return strconv.FormatFloat(v, 'g', -1, 64)
		}
		return v
	case amqp091.Decimal:
		return json.Number(decimalText(v))
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = jsonValue(e, depth+1)
		}
		return out
	case amqp091.Table:
		return jsonObject(v, depth)
	case map[string]any:
		return jsonObject(v, depth)
	}
	return fmt.Sprint(v)
}

func jsonObject(t map[string]any, depth int) map[string]any {
	out := make(map[string]any, len(t))
	for k, e := range t {
		out[k] = jsonValue(e, depth+1)
	}
	return out
}

// decimalText renders an AMQP decimal (Value × 10^-Scale) as a JSON number,
// for example {Scale: 2, Value: -12345} → "-123.45".
func decimalText(d amqp091.Decimal) string {
	v := int64(d.Value)
	sign := ""
	if v < 0 {
		sign, v = "-", -v
	}
	digits := strconv.FormatInt(v, 10)
	scale := int(d.Scale)
	if scale == 0 {
		return sign + digits
	}
	if len(digits) <= scale {
		digits = strings.Repeat("0", scale-len(digits)+1) + digits
	}
	return sign + digits[:len(digits)-scale] + "." + digits[len(digits)-scale:]
}
