// Rule reception-id: event ids minted at reception.
package eventid

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// A handler that gives the received message a new id.
func register(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pub message.Publisher) {
	c.AddHandler(r, "forward", "in", sub, "out", pub, func(msg *message.Message) ([]*message.Message, error) {
		msg.UUID = watermill.NewUUID() // want `idemvet: event id minted at reception \(a fresh id assigned to a received message's UUID\): keep the producer's event id so that a redelivery carries the same id and is claimed once`
		out := msg.Copy()
		out.UUID = uuid.NewString()                                 // want `a fresh id assigned to a received message's UUID`
		fwd := message.NewMessage(watermill.NewUUID(), msg.Payload) // want `another message's payload republished under a fresh id`
		body := msg.Payload
		again := &message.Message{UUID: uuid.New().String(), Payload: body} // want `another message's payload republished under a fresh id`

		// A new event the handler produces gets an id of its own: that is
		// a producer, not a reception.
		reserved := message.NewMessage(watermill.NewUUID(), []byte(`{"reserved":true}`))
		// Ids used for something else.
		msg.Metadata["trace"] = watermill.NewUUID()
		correlation := uuid.NewString()
		_ = correlation
		return []*message.Message{msg, out, fwd, again, reserved}, nil
	})
}

// Anywhere in the package, not only in handlers.
func restamp(msgs []*message.Message) {
	for _, m := range msgs {
		id, _ := uuid.NewV7()
		m.UUID = id.String() // want `a fresh id assigned to a received message's UUID`
	}
}

func restampMust(m *message.Message) {
	m.UUID = uuid.Must(uuid.NewRandom()).String() // want `a fresh id assigned to a received message's UUID`
	m.UUID = watermill.NewULID()                  // want `a fresh id assigned to a received message's UUID`
}

// A custom marshaler's Unmarshal: the delivery has no usable id and the
// code mints one, so each redelivery is a new event.
type marshaler struct{}

type delivery struct {
	Body      []byte
	MessageID string
}

func (marshaler) Unmarshal(d delivery) (*message.Message, error) {
	if d.MessageID == "" {
		return message.NewMessage(watermill.NewUUID(), d.Body), nil // want `a message built with a fresh id in an Unmarshal`
	}
	msg := message.NewMessage(d.MessageID, d.Body)
	if msg.UUID == "" {
		msg.UUID = watermill.NewShortUUID() // want `a fresh id assigned to a received message's UUID`
	}
	return msg, nil
}

// Name-based UUIDs derive the id from the delivery: the same delivery
// gives the same id, nothing is minted.
func (marshaler) UnmarshalForeign(d delivery) (*message.Message, error) {
	id := uuid.NewSHA1(uuid.NameSpaceURL, []byte(d.MessageID))
	return message.NewMessage(id.String(), d.Body), nil
}

// A subscriber's delivery loop.
func consume(ctx context.Context, in <-chan delivery, out chan<- *message.Message) {
	for d := range in {
		msg := message.NewMessage(watermill.NewUUID(), d.Body)
		out <- msg                                          // want `a message with a fresh id sent to a subscriber's channel`
		out <- message.NewMessage(uuid.NewString(), d.Body) // want `a message with a fresh id sent to a subscriber's channel`
		out <- message.NewMessage(d.MessageID, d.Body)
	}
}

// Producer helpers build their own messages with new ids.
func newOrderPlaced(payload []byte) (*message.Message, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return nil, err
	}
	msg := message.NewMessage(id.String(), payload)
	return msg, nil
}

func newOrderShipped(payload []byte) *message.Message {
	msg := message.NewMessage("", payload)
	msg.UUID = watermill.NewUUID()
	lit := &message.Message{Payload: payload}
	lit.UUID = uuid.NewString()
	return msg
}

// A producer helper that copies another message's payload is a
// republish: the new message is not its own.
func republish(src *message.Message) *message.Message {
	msg := message.NewMessage("", src.Payload)
	msg.UUID = watermill.NewUUID() // want `a fresh id assigned to a received message's UUID`
	return msg
}

// Copying the received id, or validating it, is what a handler should do.
func keep(msg *message.Message) (*message.Message, error) {
	if _, err := uuid.Parse(msg.UUID); err != nil {
		return nil, errors.New("bad id")
	}
	out := message.NewMessage(msg.UUID, msg.Payload)
	out.UUID = msg.UUID
	return out, nil
}
