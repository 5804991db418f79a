package amqp_test

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

func ExampleMarshaler_Marshal() {
	id := uuid.MustParse("0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d")
	at := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
	msg, err := marshaler.NewMessageWithID(id, "order.placed", at, map[string]int{"order_id": 42})
	if err != nil {
		panic(err)
	}
	pub, err := amqp.Marshaler{}.Marshal(msg)
	if err != nil {
		panic(err)
	}
	fmt.Println(pub.MessageId, pub.Type, pub.ContentType)
	fmt.Println(string(pub.Body))
	// Output:
	// 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d order.placed application/json
	// {"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"order.placed","occurred_at":"2024-07-01T10:00:00Z","payload":{"order_id":42}}
}

func ExampleMarshaler_Unmarshal() {
	// A body that is not an envelope: no error (watermill-amqp would requeue
	// it forever), but a message flagged for the dead-letter topic.
	msg, err := amqp.Marshaler{}.Unmarshal(amqp091.Delivery{
		MessageId:   "legacy-7",
		Body:        []byte(`{"order_id": 42}`),
		Redelivered: true,
		Headers:     amqp091.Table{"x-delivery-count": int64(3), "idempotency_malformed": "false"},
	})
	fmt.Println(err)
	reason, malformed := marshaler.Malformed(msg)
	fmt.Println(malformed, reason)
	fmt.Println(msg.UUID, string(msg.Payload))
	fmt.Println(msg.Metadata.Get(marshaler.MetadataRedelivered), msg.Metadata.Get(marshaler.MetadataDeliveryCount))

	extra, _ := json.Marshal(msg.Metadata.Get("x-delivery-count"))
	fmt.Println(string(extra))
	// Output:
	// <nil>
	// true envelope: event_id: missing
	// legacy-7 {"order_id": 42}
	// true 3
	// "3"
}
