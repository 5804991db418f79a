package marshaler

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// AMQP is the [amqp.Marshaler] for watermill-amqp v3 that puts messages in
// the JSON envelope (see [Envelope]). The zero value is ready to use; set it
// as the Marshaler of the publisher's and the subscriber's amqp.Config.
//
// Unmarshal never returns an error: watermill-amqp nacks a delivery *with
// requeue* when Unmarshal fails, so one undecodable message would loop hot
// forever. A delivery that is not a valid envelope becomes a message flagged
// with [MetadataMalformed] instead, for the middleware to dead-letter.
type AMQP struct {
	// MaxSize is the largest body in bytes: a larger delivery is flagged
	// malformed, and Marshal refuses to publish a larger envelope (the
	// consumers would refuse it). 0 or less means [DefaultMaxSize].
	MaxSize int
	// NotPersistent publishes with delivery mode transient (1) instead of
	// persistent (2), which the default is. Persistent messages in a durable
	// queue survive a broker restart.
	NotPersistent bool
}

var _ amqp.Marshaler = AMQP{}

// maxShortstr is the longest AMQP short string (table keys, message-id,
// type). Recent amqp091 versions fail the publish on a longer one; older ones
// silently truncated it.
const maxShortstr = 255

// Marshal turns msg into an AMQP publishing.
//
// For an ordinary message the body is the envelope built by [ToEnvelope] and
// written by [Envelope.Encode]; MessageId is the canonical event id, Type the
// event name (left empty when longer than 255 bytes, the AMQP limit),
// Timestamp occurred_at (AMQP keeps whole seconds), ContentType
// "application/json", DeliveryMode persistent unless NotPersistent. Every
// metadata entry is also sent as a string header, except the
// [MetadataExtraPrefix] ones (already in the body) and the headers RabbitMQ
// owns (x-death, x-delivery-count, x-first-death-*, x-last-death-*), which
// are not ours to send. It returns an error when msg has no valid envelope
// (in particular no valid event id), when the body exceeds MaxSize, or when a
// metadata key is longer than 255 bytes.
//
// A message flagged malformed ([Malformed]) is on its way to a dead-letter
// (poison) topic: its Payload, the raw body received, is published verbatim,
// with its metadata (reason included) as headers and msg.UUID as MessageId
// (when at most 255 bytes). Nothing is validated and over-long header keys are
// dropped, so the dead-letter queue gets the original bytes; this path never
// fails.
func (m AMQP) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	if msg == nil {
		return amqp091.Publishing{}, fmt.Errorf("marshaler: nil message")
	}
	mode := amqp091.Persistent
	if m.NotPersistent {
		mode = amqp091.Transient
	}

	if _, malformed := Malformed(msg); malformed {
		headers := make(amqp091.Table, len(msg.Metadata))
		for k, v := range msg.Metadata {
			if len(k) <= maxShortstr && !brokerHeader(k) {
				headers[k] = v
			}
		}
		pub := amqp091.Publishing{Headers: headers, DeliveryMode: mode, Body: msg.Payload}
		if len(msg.UUID) <= maxShortstr {
			pub.MessageId = msg.UUID
		}
		return pub, nil
	}

	env, err := ToEnvelope(msg)
	if err != nil {
		return amqp091.Publishing{}, err
	}
	body, err := env.Encode()
	if err != nil {
		return amqp091.Publishing{}, fmt.Errorf("marshaler: %w", err)
	}
	if limit := m.maxSize(); len(body) > limit {
		return amqp091.Publishing{}, fmt.Errorf("marshaler: envelope is %d bytes, over the limit of %d bytes", len(body), limit)
	}
	headers := make(amqp091.Table, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if strings.HasPrefix(k, MetadataExtraPrefix) || brokerHeader(k) {
			continue
		}
		if len(k) > maxShortstr {
			return amqp091.Publishing{}, fmt.Errorf("marshaler: metadata key of %d bytes, over the AMQP limit of %d", len(k), maxShortstr)
		}
		headers[k] = v
	}
	pub := amqp091.Publishing{
		Headers:      headers,
		ContentType:  "application/json",
		DeliveryMode: mode,
		MessageId:    env.EventID.String(),
		Timestamp:    env.OccurredAt,
		Body:         body,
	}
	if len(env.EventName) <= maxShortstr {
		pub.Type = env.EventName
	}
	return pub, nil
}

// brokerHeader reports whether RabbitMQ sets the header itself.
func brokerHeader(k string) bool {
	return k == "x-death" || k == headerDeliveryCount ||
		strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")
}

func (m AMQP) maxSize() int {
	if m.MaxSize <= 0 {
		return DefaultMaxSize
	}
	return m.MaxSize
}

// Unmarshal turns a delivery into a message. It never returns an error (see
// [AMQP]).
//
// A body that [Decode] accepts gives msg.UUID = the canonical event_id (the
// delivery's MessageId is ignored), msg.Payload = the payload bytes as
// received, and metadata [MetadataEventName], [MetadataOccurredAt] and the
// [MetadataExtraPrefix] keys from the envelope.
//
// Any other body (empty, not JSON, truncated, oversized, event_id missing,
// not a UUID or nil, event_name missing, occurred_at invalid, payload
// missing…) gives a message with Payload = the raw body, unchanged,
// [MetadataMalformed] = "true", [MetadataMalformedReason] = the [DecodeError]
// text, and msg.UUID = the delivery's MessageId, or a new random id when it
// is empty. That UUID is not an event id and must not be used to deduplicate.
//
// In both cases every header becomes metadata text: strings as they are,
// []byte as its bytes, numbers and booleans in Go's decimal notation,
// time.Time as RFC 3339 with nanoseconds in UTC, amqp091.Decimal as a decimal
// number, arrays and tables (x-death is an array of tables) as JSON, a void
// value as "". Headers named like the keys this package derives
// ([MetadataEventName], [MetadataOccurredAt], [MetadataMalformed],
// [MetadataMalformedReason], [MetadataRedelivered], [MetadataDeliveryCount],
// [MetadataExtraPrefix]*) are dropped: the delivery decides those. Then
// [MetadataRedelivered] is set from the delivery's redelivered flag and
// [MetadataDeliveryCount] from an integer x-delivery-count header.
func (m AMQP) Unmarshal(d amqp091.Delivery) (msg *message.Message, _ error) {
	defer func() {
		// Belt and braces: a panic here would kill the subscriber, and an
		// error would loop; a flagged message is the one safe outcome.
		if r := recover(); r != nil {
			msg = malformedMessage(d, fmt.Sprintf("marshaler: internal error decoding the delivery: %v", r))
			msg.Metadata.Set(MetadataRedelivered, strconv.FormatBool(d.Redelivered))
		}
	}()

	env, err := Decode(d.Body, m.maxSize())
	if err != nil {
		msg = malformedMessage(d, err.Error())
	} else {
		msg = message.NewMessage(env.EventID.String(), message.Payload(env.Payload))
	}
	for k, v := range d.Headers {
		if !reservedKey(k) {
			msg.Metadata.Set(k, headerText(v))
		}
	}
	if err == nil {
		msg.Metadata.Set(MetadataEventName, env.EventName)
		at, _ := env.occurredAtString() // decoded text: never fails
		msg.Metadata.Set(MetadataOccurredAt, at)
		for k, v := range env.Extra {
			msg.Metadata.Set(MetadataExtraPrefix+k, string(v))
		}
	}
	msg.Metadata.Set(MetadataRedelivered, strconv.FormatBool(d.Redelivered))
	if n, ok := deliveryCount(d.Headers[headerDeliveryCount]); ok {
		msg.Metadata.Set(MetadataDeliveryCount, n)
	}
	return msg, nil
}

func malformedMessage(d amqp091.Delivery, reason string) *message.Message {
	id := d.MessageId
	if id == "" {
		id = watermill.NewUUID()
	}
	msg := message.NewMessage(id, append(message.Payload(nil), d.Body...))
	msg.Metadata.Set(MetadataMalformed, "true")
	msg.Metadata.Set(MetadataMalformedReason, reason)
	return msg
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
