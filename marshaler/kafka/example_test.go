package kafka_test

import (
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

// The envelope on Kafka: the event id travels in the envelope and comes back
// as msg.UUID; input that is no envelope is flagged for the poison topic,
// never an unmarshal error.
func Example() {
	id := uuid.MustParse("01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b")
	msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC), map[string]string{"order_id": "o-42"})
	if err != nil {
		panic(err)
	}
	var m kafka.Marshaler
	rec, err := m.Marshal("orders", msg)
	if err != nil {
		panic(err)
	}
	value, _ := rec.Value.Encode()
	got, _ := m.Unmarshal(&sarama.ConsumerMessage{Topic: "orders", Partition: 0, Offset: 7, Value: value})
	fmt.Println(got.UUID, marshaler.EventName(got))

	bad, err := m.Unmarshal(&sarama.ConsumerMessage{Topic: "orders", Offset: 8, Value: []byte("not json")})
	_, malformed := marshaler.Malformed(bad)
	fmt.Println(err, malformed)
	// Output:
	// 01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b order.placed
	// <nil> true
}
