package jetstream_test

import (
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
)

// The envelope on NATS JetStream: Marshal sets the Nats-Msg-Id header from
// the event id (JetStream's duplicate window then drops a republish through
// watermill-nats' publisher; Publisher sets an id per publish), Unmarshal gives the event id back as msg.UUID, and a body that
// is no envelope is flagged, never an error (watermill-nats would leave it
// unacked, redelivered every AckWait forever).
func Example() {
	id := uuid.MustParse("01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b")
	msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC), map[string]string{"order_id": "o-42"})
	if err != nil {
		panic(err)
	}
	var m jetstream.Marshaler
	nm, err := m.Marshal("orders", msg)
	if err != nil {
		panic(err)
	}
	fmt.Println(nm.Header.Get(nats.MsgIdHdr))
	got, _ := m.Unmarshal(nm)
	fmt.Println(got.UUID, marshaler.EventName(got))

	bad, err := m.Unmarshal(&nats.Msg{Subject: "orders", Data: []byte("not json")})
	_, malformed := marshaler.Malformed(bad)
	fmt.Println(err, malformed)
	// Output:
	// 01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b:orders
	// 01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b order.placed
	// <nil> true
}
