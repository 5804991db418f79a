// Package message is a stub of github.com/ThreeDotsLabs/watermill/message.
package message

import "context"

type Payload []byte

type Metadata map[string]string

type Message struct {
	UUID     string
	Metadata Metadata
	Payload  Payload
}

func NewMessage(uuid string, payload Payload) *Message {
	return &Message{UUID: uuid, Payload: payload}
}

func (m *Message) Context() context.Context { return context.Background() }
func (m *Message) Copy() *Message           { return &Message{UUID: m.UUID, Payload: m.Payload} }

type HandlerFunc func(msg *Message) ([]*Message, error)

type NoPublishHandlerFunc func(msg *Message) error

type Router struct{}

type Handler struct{}

type Subscriber interface {
	Subscribe(ctx context.Context, topic string) (<-chan *Message, error)
}

type Publisher interface {
	Publish(topic string, messages ...*Message) error
}
