package amqp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// deliver turns a publishing into the delivery a consumer would get.
func deliver(p amqp091.Publishing) amqp091.Delivery {
	return amqp091.Delivery{
		Headers:      p.Headers,
		ContentType:  p.ContentType,
		DeliveryMode: p.DeliveryMode,
		MessageId:    p.MessageId,
		Timestamp:    p.Timestamp,
		Type:         p.Type,
		Body:         p.Body,
	}
}

func TestAMQPRoundTrip(t *testing.T) {
	t.Parallel()
	at := time.Date(2024, 7, 1, 12, 0, 0, 123456789, time.FixedZone("", 2*3600))
	in, err := marshaler.NewMessageWithID(uuid.MustParse(strings.ToUpper(testID)), "order.placed", at,
		json.RawMessage(`{"b":1,  "a":"2.000"}`))
	require.NoError(t, err)
	in.Metadata.Set("correlation_id", "c-1")
	in.Metadata.Set(marshaler.MetadataExtraPrefix+"tenant", `"acme"`)

	pub, err := Marshaler{}.Marshal(in)
	require.NoError(t, err)
	require.Equal(t, testID, pub.MessageId)
	require.Equal(t, "order.placed", pub.Type)
	require.Equal(t, "application/json", pub.ContentType)
	require.Equal(t, amqp091.Persistent, pub.DeliveryMode)
	require.True(t, pub.Timestamp.Equal(at))
	require.Equal(t, "c-1", pub.Headers["correlation_id"])
	require.Equal(t, "order.placed", pub.Headers[marshaler.MetadataEventName])
	require.NotContains(t, pub.Headers, marshaler.MetadataExtraPrefix+"tenant", "extras travel in the body")
	require.NoError(t, pub.Headers.Validate())
	require.Equal(t, `{"event_id":"`+testID+`","event_name":"order.placed","occurred_at":"2024-07-01T12:00:00.123456789+02:00",`+
		`"payload":{"b":1,  "a":"2.000"},"tenant":"acme"}`, string(pub.Body))

	d := deliver(pub)
	d.Redelivered = true
	out, err := Marshaler{}.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, testID, out.UUID)
	require.Equal(t, `{"b":1,  "a":"2.000"}`, string(out.Payload))
	require.Equal(t, "order.placed", marshaler.EventName(out))
	got, err := marshaler.OccurredAt(out)
	require.NoError(t, err)
	require.True(t, got.Equal(at))
	require.Equal(t, `"acme"`, out.Metadata.Get(marshaler.MetadataExtraPrefix+"tenant"))
	require.Equal(t, "c-1", out.Metadata.Get("correlation_id"))
	require.Equal(t, "true", out.Metadata.Get(marshaler.MetadataRedelivered))
	require.True(t, marshaler.Redelivered(out))
	_, malformed := marshaler.Malformed(out)
	require.False(t, malformed)
	_, ok := marshaler.DeliveryCount(out)
	require.False(t, ok)

	// And back out again, unchanged.
	pub2, err := Marshaler{}.Marshal(out)
	require.NoError(t, err)
	require.Equal(t, pub.Body, pub2.Body)
}

func TestAMQPNotPersistent(t *testing.T) {
	t.Parallel()
	msg, err := marshaler.NewMessage("x", 1)
	require.NoError(t, err)
	pub, err := Marshaler{NotPersistent: true}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, amqp091.Transient, pub.DeliveryMode)
}

func TestAMQPMarshalRefusals(t *testing.T) {
	t.Parallel()
	good := func() *message.Message {
		msg, err := marshaler.NewMessage("order.placed", map[string]int{"a": 1})
		require.NoError(t, err)
		return msg
	}
	tests := map[string]func(m *message.Message){
		"empty UUID":         func(m *message.Message) { m.UUID = "" },
		"not a UUID":         func(m *message.Message) { m.UUID = "order-42" },
		"nil UUID":           func(m *message.Message) { m.UUID = uuid.Nil.String() },
		"no event name":      func(m *message.Message) { delete(m.Metadata, marshaler.MetadataEventName) },
		"no occurred_at":     func(m *message.Message) { delete(m.Metadata, marshaler.MetadataOccurredAt) },
		"bad occurred_at":    func(m *message.Message) { m.Metadata.Set(marshaler.MetadataOccurredAt, "yesterday") },
		"payload not JSON":   func(m *message.Message) { m.Payload = []byte("hello") },
		"empty payload":      func(m *message.Message) { m.Payload = nil },
		"bad extra":          func(m *message.Message) { m.Metadata.Set(marshaler.MetadataExtraPrefix+"a", "nope") },
		"extra names field":  func(m *message.Message) { m.Metadata.Set(marshaler.MetadataExtraPrefix+"event_id", `"x"`) },
		"long metadata key":  func(m *message.Message) { m.Metadata.Set(strings.Repeat("k", 256), "v") },
		"malformed is false": func(m *message.Message) { m.Metadata.Set(marshaler.MetadataMalformed, "yes"); m.UUID = "" },
	}
	for name, mutate := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			msg := good()
			mutate(msg)
			_, err := Marshaler{}.Marshal(msg)
			require.Error(t, err)
		})
	}

	big, err := marshaler.NewMessage("x", json.RawMessage(`"`+strings.Repeat("a", 200)+`"`))
	require.NoError(t, err)
	_, err = Marshaler{MaxSize: 200}.Marshal(big)
	require.ErrorContains(t, err, "over the limit")

	_, err = Marshaler{}.Marshal(nil)
	require.Error(t, err)
}

func TestAMQPMarshalLongEventName(t *testing.T) {
	t.Parallel()
	name := strings.Repeat("n", 300)
	msg, err := marshaler.NewMessage(name, nil)
	require.NoError(t, err)
	pub, err := Marshaler{}.Marshal(msg)
	require.NoError(t, err)
	require.Empty(t, pub.Type, "the AMQP type property holds at most 255 bytes")
	out, err := Marshaler{}.Unmarshal(deliver(pub))
	require.NoError(t, err)
	require.Equal(t, name, marshaler.EventName(out))
}

func TestAMQPMarshalDropsBrokerHeaders(t *testing.T) {
	t.Parallel()
	msg, err := marshaler.NewMessage("x", nil)
	require.NoError(t, err)
	for _, k := range []string{"x-death", "x-delivery-count", "x-first-death-queue", "x-last-death-reason"} {
		msg.Metadata.Set(k, "1")
	}
	msg.Metadata.Set("x-delay", "5000")
	pub, err := Marshaler{}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, "5000", pub.Headers["x-delay"])
	for k := range pub.Headers {
		require.False(t, brokerHeader(k), k)
	}
}

func TestAMQPUnmarshalMalformed(t *testing.T) {
	t.Parallel()
	id := `"` + testID + `"`
	name := `"order.placed"`
	at := `"2024-07-01T10:00:00Z"`
	tests := []struct {
		name  string
		body  []byte
		field string // mentioned in the reason
	}{
		{"empty", []byte{}, "empty body"},
		{"truncated", []byte(`{"event_id":`), "not valid JSON"},
		{"not JSON", []byte("\x00\xff binary"), "not valid JSON"},
		{"no event_id", envelopeJSON(nil, &name, &at, ptr(`{}`)), "event_id"},
		{"not a uuid", envelopeJSON(ptr(`"not-a-uuid"`), &name, &at, ptr(`{}`)), "event_id"},
		{"empty event_id", envelopeJSON(ptr(`""`), &name, &at, ptr(`{}`)), "event_id"},
		{"numeric event_id", envelopeJSON(ptr(`12345`), &name, &at, ptr(`{}`)), "event_id"},
		{"nil uuid", envelopeJSON(ptr(`"00000000-0000-0000-0000-000000000000"`), &name, &at, ptr(`{}`)), "event_id"},
		{"no event_name", envelopeJSON(&id, nil, &at, ptr(`{}`)), "event_name"},
		{"bad occurred_at", envelopeJSON(&id, &name, ptr(`"today"`), ptr(`{}`)), "occurred_at"},
		{"no payload", envelopeJSON(&id, &name, &at, nil), "payload"},
		{"oversized", envelopeJSON(&id, &name, &at, ptr(`"`+strings.Repeat("a", marshaler.DefaultMaxSize)+`"`)), "over the limit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			for _, messageID := range []string{"", "broker-id-1"} {
				d := amqp091.Delivery{
					Body:      append([]byte(nil), tt.body...),
					MessageId: messageID,
					Headers:   amqp091.Table{"x-delivery-count": int64(3)},
				}
				msg, err := Marshaler{}.Unmarshal(d)
				require.NoError(t, err)
				require.NotNil(t, msg)
				require.True(t, bytes.Equal(tt.body, msg.Payload), "raw body kept")
				reason, ok := marshaler.Malformed(msg)
				require.True(t, ok)
				require.Contains(t, reason, tt.field)
				require.True(t, strings.HasPrefix(reason, "envelope: "), reason)
				require.Equal(t, "false", msg.Metadata.Get(marshaler.MetadataRedelivered))
				require.Equal(t, "3", msg.Metadata.Get(marshaler.MetadataDeliveryCount))
				require.Empty(t, marshaler.EventName(msg))
				if messageID != "" {
					require.Equal(t, messageID, msg.UUID)
				} else {
					require.NotEmpty(t, msg.UUID)
				}
				_, err = marshaler.ToEnvelope(msg)
				require.Error(t, err)

				// On its way to the dead-letter topic: raw body, reason as a header.
				pub, err := Marshaler{}.Marshal(msg)
				require.NoError(t, err)
				require.True(t, bytes.Equal(tt.body, pub.Body))
				require.Equal(t, msg.UUID, pub.MessageId)
				require.Equal(t, "true", pub.Headers[marshaler.MetadataMalformed])
				require.Equal(t, reason, pub.Headers[marshaler.MetadataMalformedReason])
				require.NotContains(t, pub.Headers, "x-delivery-count")
				require.NoError(t, pub.Headers.Validate())

				// Read back from the dead-letter queue: still flagged, same bytes.
				again, err := Marshaler{}.Unmarshal(deliver(pub))
				require.NoError(t, err)
				r2, ok := marshaler.Malformed(again)
				require.True(t, ok)
				require.Equal(t, reason, r2)
				require.True(t, bytes.Equal(tt.body, again.Payload))
			}
		})
	}
}

func TestAMQPUnmarshalMaxSize(t *testing.T) {
	t.Parallel()
	body := validBody()
	msg, err := Marshaler{MaxSize: len(body)}.Unmarshal(amqp091.Delivery{Body: body})
	require.NoError(t, err)
	_, ok := marshaler.Malformed(msg)
	require.False(t, ok)

	msg, err = Marshaler{MaxSize: len(body) - 1}.Unmarshal(amqp091.Delivery{Body: body})
	require.NoError(t, err)
	reason, ok := marshaler.Malformed(msg)
	require.True(t, ok)
	require.Contains(t, reason, "over the limit")
	require.Equal(t, body, []byte(msg.Payload))
}

func TestAMQPUnmarshalIgnoresMessageIDOfValidBody(t *testing.T) {
	t.Parallel()
	msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), MessageId: "something-else"})
	require.NoError(t, err)
	require.Equal(t, testID, msg.UUID)
}

func TestAMQPHeaderTypes(t *testing.T) {
	t.Parallel()
	ts := time.Date(2024, 7, 1, 12, 0, 0, 0, time.FixedZone("", 2*3600))
	headers := amqp091.Table{
		"x-death": []interface{}{
			amqp091.Table{
				"count":        int64(2),
				"exchange":     "orders",
				"queue":        "orders.q",
				"reason":       "rejected",
				"routing-keys": []interface{}{"order.placed"},
				"time":         ts,
			},
		},
		"x-delivery-count": int32(4),
		"str":              "hello",
		"bool":             true,
		"f64":              1.5,
		"f32":              float32(0.25),
		"nan":              math.NaN(),
		"i8":               int8(-8),
		"i16":              int16(16),
		"u8":               uint8(200),
		"ts":               ts,
		"bytes":            []byte("raw\x00bytes"),
		"void":             nil,
		"decimal":          amqp091.Decimal{Scale: 2, Value: -12345},
		"nested":           amqp091.Table{"a": amqp091.Table{"b": []interface{}{int16(1), nil, []byte("x"), math.Inf(1)}}},
		"empty-array":      []interface{}{},
	}
	msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), Headers: headers})
	require.NoError(t, err)
	md := msg.Metadata

	require.Equal(t, `[{"count":2,"exchange":"orders","queue":"orders.q","reason":"rejected","routing-keys":["order.placed"],"time":"2024-07-01T10:00:00Z"}]`, md.Get("x-death"))
	require.Equal(t, "4", md.Get("x-delivery-count"))
	require.Equal(t, "4", md.Get(marshaler.MetadataDeliveryCount))
	n, ok := marshaler.DeliveryCount(msg)
	require.True(t, ok)
	require.Equal(t, int64(4), n)
	require.Equal(t, "hello", md.Get("str"))
	require.Equal(t, "true", md.Get("bool"))
	require.Equal(t, "1.5", md.Get("f64"))
	require.Equal(t, "0.25", md.Get("f32"))
	require.Equal(t, "NaN", md.Get("nan"))
	require.Equal(t, "-8", md.Get("i8"))
	require.Equal(t, "16", md.Get("i16"))
	require.Equal(t, "200", md.Get("u8"))
	require.Equal(t, "2024-07-01T10:00:00Z", md.Get("ts"))
	require.Equal(t, "raw\x00bytes", md.Get("bytes"))
	require.Contains(t, md, "void")
	require.Equal(t, "", md.Get("void"))
	require.Equal(t, "-123.45", md.Get("decimal"))
	require.Equal(t, `{"a":{"b":[1,null,"x","+Inf"]}}`, md.Get("nested"))
	require.Equal(t, `[]`, md.Get("empty-array"))

	// The same headers on a malformed delivery are carried just the same.
	bad, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: []byte("nope"), Headers: headers})
	require.NoError(t, err)
	require.Equal(t, md.Get("x-death"), bad.Metadata.Get("x-death"))
	require.Equal(t, "4", bad.Metadata.Get(marshaler.MetadataDeliveryCount))
}

func TestAMQPDeliveryCountTypes(t *testing.T) {
	t.Parallel()
	for _, v := range []any{int8(7), int16(7), int32(7), int64(7), int(7), uint8(7), uint16(7), uint32(7), uint64(7), uint(7)} {
		msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), Headers: amqp091.Table{"x-delivery-count": v}})
		require.NoError(t, err)
		require.Equal(t, "7", msg.Metadata.Get(marshaler.MetadataDeliveryCount), "%T", v)
	}
	for _, v := range []any{"7", 7.0, int64(-1), nil, true} {
		msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), Headers: amqp091.Table{"x-delivery-count": v}})
		require.NoError(t, err)
		require.NotContains(t, msg.Metadata, marshaler.MetadataDeliveryCount, "%T %v", v, v)
		_, ok := marshaler.DeliveryCount(msg)
		require.False(t, ok)
	}
}

func TestAMQPReservedHeadersIgnored(t *testing.T) {
	t.Parallel()
	spoof := amqp091.Table{
		marshaler.MetadataMalformed:               "true",
		marshaler.MetadataMalformedReason:         "spoofed",
		marshaler.MetadataEventName:               "payment.refunded",
		marshaler.MetadataOccurredAt:              "1999-01-01T00:00:00Z",
		marshaler.MetadataRedelivered:             "true",
		marshaler.MetadataDeliveryCount:           "99",
		marshaler.MetadataExtraPrefix + "tenant":  `"evil"`,
		marshaler.MetadataExtraPrefix + "payload": `"evil"`,
		"harmless": "kept",
	}

	// A valid envelope cannot be flagged, renamed or re-dated by headers.
	msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), Headers: spoof})
	require.NoError(t, err)
	_, ok := marshaler.Malformed(msg)
	require.False(t, ok)
	require.NotContains(t, msg.Metadata, marshaler.MetadataMalformed)
	require.NotContains(t, msg.Metadata, marshaler.MetadataMalformedReason)
	require.Equal(t, "order.placed", marshaler.EventName(msg))
	require.Equal(t, "2024-07-01T10:00:00.000Z", msg.Metadata.Get(marshaler.MetadataOccurredAt))
	require.Equal(t, "false", msg.Metadata.Get(marshaler.MetadataRedelivered))
	require.NotContains(t, msg.Metadata, marshaler.MetadataDeliveryCount)
	require.NotContains(t, msg.Metadata, marshaler.MetadataExtraPrefix+"tenant")
	require.NotContains(t, msg.Metadata, marshaler.MetadataExtraPrefix+"payload")
	require.Equal(t, "kept", msg.Metadata.Get("harmless"))
	_, err = Marshaler{}.Marshal(msg)
	require.NoError(t, err)

	// A malformed one cannot be unflagged or given a name.
	spoof[marshaler.MetadataMalformed] = "false"
	bad, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: []byte("{"), Headers: spoof})
	require.NoError(t, err)
	reason, ok := marshaler.Malformed(bad)
	require.True(t, ok)
	require.NotEqual(t, "spoofed", reason)
	require.Empty(t, marshaler.EventName(bad))
	require.NotContains(t, bad.Metadata, marshaler.MetadataOccurredAt)
}

func TestAMQPUnmarshalDoesNotAliasBody(t *testing.T) {
	t.Parallel()
	for _, body := range [][]byte{validBody(), []byte("not json")} {
		want := append([]byte(nil), body...)
		msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: body})
		require.NoError(t, err)
		for i := range body {
			body[i] = 'X'
		}
		if _, bad := marshaler.Malformed(msg); bad {
			require.Equal(t, want, []byte(msg.Payload))
		} else {
			require.Equal(t, `{"order_id":42}`, string(msg.Payload))
		}
	}
}

func TestAMQPUnmarshalCyclicHeaders(t *testing.T) {
	t.Parallel()
	cyc := amqp091.Table{}
	cyc["self"] = cyc
	arr := []interface{}{nil}
	arr[0] = arr
	msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{Body: validBody(), Headers: amqp091.Table{"cyc": cyc, "arr": arr}})
	require.NoError(t, err)
	require.Contains(t, msg.Metadata.Get("cyc"), "nested too deep")
	require.Contains(t, msg.Metadata.Get("arr"), "nested too deep")
}

func TestDecimalText(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		d    amqp091.Decimal
		want string
	}{
		{amqp091.Decimal{Scale: 0, Value: 5}, "5"},
		{amqp091.Decimal{Scale: 0, Value: -5}, "-5"},
		{amqp091.Decimal{Scale: 2, Value: 12345}, "123.45"},
		{amqp091.Decimal{Scale: 3, Value: -5}, "-0.005"},
		{amqp091.Decimal{Scale: 1, Value: 0}, "0.0"},
		{amqp091.Decimal{Scale: 2, Value: math.MinInt32}, "-21474836.48"},
	} {
		got := decimalText(tt.d)
		require.Equal(t, tt.want, got)
		require.True(t, json.Valid([]byte(got)))
	}
}

const testID = "0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d"

// envelopeJSON builds an envelope body from raw member texts; a nil value
// omits the member.
func envelopeJSON(id, name, at, payload *string, extra ...string) []byte {
	var members []string
	add := func(k string, v *string) {
		if v != nil {
			members = append(members, fmt.Sprintf("%q:%s", k, *v))
		}
	}
	add("event_id", id)
	add("event_name", name)
	add("occurred_at", at)
	add("payload", payload)
	members = append(members, extra...)
	return []byte("{" + strings.Join(members, ",") + "}")
}

func ptr(s string) *string { return &s }

func validBody() []byte {
	return envelopeJSON(ptr(`"`+testID+`"`), ptr(`"order.placed"`), ptr(`"2024-07-01T10:00:00.000Z"`), ptr(`{"order_id":42}`))
}

// TestAMQPCloudEventsBinary: the AMQP binding's cloudEvents:* headers (and
// the older cloudEvents_*) carry the attributes; a non-UUID id needs a
// ClaimKey.
func TestAMQPCloudEventsBinary(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"cloudEvents:", "cloudEvents_"} {
		d := amqp091.Delivery{Body: []byte(`{"order_id":42}`), Headers: amqp091.Table{
			p + "specversion": "1.0", p + "id": "order-42", p + "source": "/shop",
			p + "type": "order.placed", p + "time": "2024-07-01T10:00:00Z",
		}}
		msg, err := Marshaler{}.Unmarshal(d)
		require.NoError(t, err)
		_, bad := marshaler.Malformed(msg)
		require.True(t, bad, "non-UUID id, no ClaimKey")

		m := Marshaler{ClaimKey: marshaler.UUIDv5ClaimKey(uuid.MustParse(testID))}
		msg, err = m.Unmarshal(d)
		require.NoError(t, err)
		_, bad = marshaler.Malformed(msg)
		require.False(t, bad, msg.Metadata.Get(marshaler.MetadataMalformedReason))
		require.Equal(t, "order.placed", marshaler.EventName(msg))
		again, _ := m.Unmarshal(d)
		require.Equal(t, msg.UUID, again.UUID)
	}
}

// The zero Delivery, what watermill-amqp reads from a delivery channel the
// broker closed, is refused (no message to dead-letter); a delivery with
// any field set, an empty body included, is still a message.
func TestUnmarshalRefusesOnlyTheZeroDelivery(t *testing.T) {
	msg, err := Marshaler{}.Unmarshal(amqp091.Delivery{})
	require.ErrorIs(t, err, errNoDelivery)
	require.Nil(t, msg)
	for name, d := range map[string]amqp091.Delivery{
		"empty body":   {Body: []byte{}},
		"delivery tag": {DeliveryTag: 1},
		"routing key":  {RoutingKey: "q"},
	} {
		msg, err := Marshaler{}.Unmarshal(d)
		require.NoError(t, err, name)
		_, flagged := marshaler.Malformed(msg)
		require.True(t, flagged, name)
	}
}
