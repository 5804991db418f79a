package marshaler_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

func ExampleParseEventID() {
	for _, s := range []string{
		"0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D",
		"{0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d}",
		"0190a0c17c2e7b619d4e3f1f5a2b6c7d",
		"urn:uuid:0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"00000000-0000-0000-0000-000000000000",
		"order-42",
	} {
		id, err := marshaler.ParseEventID(s)
		switch {
		case errors.Is(err, marshaler.ErrNilEventID):
			fmt.Println("refused, nil:", err)
		case err != nil:
			fmt.Println("refused:", err)
		default:
			fmt.Println(id)
		}
	}
	// Output:
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d
	// refused, nil: event id: nil UUID
	// refused: event id: not a UUID (8 characters)
}

func ExampleDecode() {
	body := []byte(`{"event_id": "0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D", "event_name": "order.placed",
		"occurred_at": "2024-07-01T12:00:00.000+02:00", "payload": {"b":1,  "a":"2.000"}, "tenant": "acme"}`)
	env, err := marshaler.Decode(body, 0)
	if err != nil {
		panic(err)
	}
	fmt.Println(env.EventID)
	fmt.Println(env.OccurredAt.UTC())
	fmt.Println(string(env.Payload))

	out, _ := env.Encode()
	fmt.Println(string(out))

	_, err = marshaler.Decode([]byte(`{"event_id": 12345}`), 0)
	var de *marshaler.DecodeError
	fmt.Println(errors.Is(err, marshaler.ErrMalformed), errors.As(err, &de) && de.Field == "event_id", err)
	// Output:
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d
	// 2024-07-01 10:00:00 +0000 UTC
	// {"b":1,  "a":"2.000"}
	// {"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"order.placed","occurred_at":"2024-07-01T12:00:00.000+02:00","payload":{"b":1,  "a":"2.000"},"tenant":"acme"}
	// true true envelope: event_id: not a JSON string (got number)
}

func ExampleNewMessageWithID() {
	id := uuid.MustParse("0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d")
	at := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
	msg, err := marshaler.NewMessageWithID(id, "order.placed", at, map[string]int{"order_id": 42})
	if err != nil {
		panic(err)
	}
	body, headers, err := marshaler.EncodeMessage(msg, 0)
	if err != nil {
		panic(err)
	}
	fmt.Println(msg.UUID, headers[marshaler.MetadataEventName])
	fmt.Println(string(body))
	// Output:
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d order.placed
	// {"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"order.placed","occurred_at":"2024-07-01T10:00:00Z","payload":{"order_id":42}}
}

func ExampleDecodeMessage() {
	// A body that is not an envelope: no error (a subscriber would redeliver
	// it forever), but a message flagged for the dead-letter topic.
	msg := marshaler.DecodeMessage([]byte(`{"order_id": 42}`), 0, "legacy-7")
	reason, malformed := marshaler.Malformed(msg)
	fmt.Println(malformed, reason)
	fmt.Println(msg.UUID, string(msg.Payload))
	// Output:
	// true envelope: event_id: missing
	// legacy-7 {"order_id": 42}
}
