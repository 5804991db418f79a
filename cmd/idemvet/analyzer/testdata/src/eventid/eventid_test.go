package eventid

import (
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Tests produce the events they deliver: not reported.
func newTestMessage(template *message.Message) *message.Message {
	m := template.Copy()
	m.UUID = watermill.NewUUID()
	return m
}
