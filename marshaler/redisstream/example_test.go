package redisstream_test

import (
	"fmt"
	"time"

	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/redisstream"
)

// The envelope on Redis Streams: the event id travels in the envelope and comes back
// as msg.UUID; input that is no envelope is flagged for the poison topic,
// never an unmarshal error.
func Example() {
	id := uuid.MustParse("01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b")
	msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC), map[string]string{"order_id": "o-42"})
	if err != nil {
		panic(err)
	}
	var m redisstream.Marshaler
	fields, err := m.Marshal("orders", msg)
	if err != nil {
		panic(err)
	}
	got, _ := m.Unmarshal(fields)
	fmt.Println(got.UUID, marshaler.EventName(got))

	// An entry that is no Watermill entry at all: flagged, never an error
	// (watermill-redisstream stops the subscription on one).
	bad, err := m.Unmarshal(map[string]interface{}{"foo": "bar"})
	_, malformed := marshaler.Malformed(bad)
	fmt.Println(err, malformed)
	// Output:
	// 01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b order.placed
	// <nil> true
}

// The subscriber of a consumer group, wired so that each delivery carries
// Redis' delivery count: a first read writes no crash count, and a
// message that keeps killing the process is dead-lettered after
// middleware.ConsumerConfig.MaxCrashes crashes.
func ExampleCountingClient() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client:        redisstream.CountingClient(client), // marks first reads and claims
		Unmarshaller:  redisstream.Marshaler{},
		ConsumerGroup: "stock",
	}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	// Hand sub to middleware.NewConsumer's AddConsumerHandler.
}
