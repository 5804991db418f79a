package amqp

import (
	"bytes"
	"strings"
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// amqpFuzzSeeds are a few valid and refused bodies (the envelope's own fuzz
// corpus is in package marshaler).
var amqpFuzzSeeds = []string{
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"order.placed","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":42}}`,
	`{"event_id":"{0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D}","event_name":"x","occurred_at":"2024-07-01t10:00:00.123456789+02:00","payload":null,"tenant":"acme"}`,
	`{"event_id":"00000000-0000-0000-0000-000000000000","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":"not-a-uuid","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":`,
	`{"specversion":"1.0","id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","source":"/s","type":"x","time":"2024-07-01T10:00:00Z","data":{"a":1}}`,
	`{"specversion":"1.0","id":"not-a-uuid","source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
	`null`,
	``,
	"\x00",
}

// FuzzUnmarshal checks that Unmarshal never errors or panics whatever the body,
// message id and headers, keeps a refused body byte for byte, and that Marshal
// of its result succeeds and reads back the same.
func FuzzUnmarshal(f *testing.F) {
	for _, s := range amqpFuzzSeeds {
		f.Add([]byte(s), "", "x-delivery-count", int64(2), "v", true)
		f.Add([]byte(s), "broker-id", marshaler.MetadataMalformed, int64(-1), "true", false)
	}
	f.Fuzz(func(t *testing.T, body []byte, messageID, headerKey string, n int64, s string, redelivered bool) {
		if len(messageID) > maxShortstr {
			messageID = messageID[:maxShortstr]
		}
		if len(headerKey) > maxShortstr {
			headerKey = headerKey[:maxShortstr]
		}
		d := amqp091.Delivery{
			Body:        body,
			MessageId:   messageID,
			Redelivered: redelivered,
			Headers: amqp091.Table{
				headerKey: s,
				"n":       n,
				"x-death": []interface{}{amqp091.Table{"count": n, "reason": s, "raw": []byte(s)}},
				"nested":  amqp091.Table{headerKey: []interface{}{s, float64(n) / 3, nil}},
			},
		}
		msg, err := Marshaler{}.Unmarshal(d)
		if err != nil || msg == nil {
			t.Fatalf("Unmarshal returned %v, %v", msg, err)
		}
		_, flagged := marshaler.Malformed(msg)
		if _, decodeErr := marshaler.Decode(body, 0); decodeErr == nil && flagged {
			t.Fatalf("flagged a valid envelope")
		} else if decodeErr != nil && !flagged && !strings.Contains(string(body), "specversion") {
			t.Fatalf("not flagged but Decode error %v (and not a CloudEvent)", decodeErr)
		}
		if flagged && !bytes.Equal(body, msg.Payload) {
			t.Fatalf("raw body not kept")
		}
		if msg.UUID == "" {
			t.Fatalf("empty UUID")
		}

		pub, err := Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatalf("Marshal of an unmarshalled message: %v", err)
		}
		if err := pub.Headers.Validate(); err != nil {
			t.Fatalf("headers: %v", err)
		}
		back, err := Marshaler{}.Unmarshal(deliver(pub))
		if err != nil {
			t.Fatalf("second Unmarshal: %v", err)
		}
		_, flaggedAgain := marshaler.Malformed(back)
		if flaggedAgain != flagged || back.UUID != msg.UUID || !bytes.Equal(back.Payload, msg.Payload) {
			t.Fatalf("round trip changed the message: %v %q %q / %v %q %q",
				flagged, msg.UUID, msg.Payload, flaggedAgain, back.UUID, back.Payload)
		}
		if !flagged && marshaler.EventName(back) != marshaler.EventName(msg) {
			t.Fatalf("event name changed")
		}
	})
}
