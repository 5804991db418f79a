package inbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// The handler's message keeps watermill's contract for Acked and Nacked:
// the channel they return is closed when the message is acked (nacked),
// also when it was taken before (a handler that hands its message to a
// worker and waits for the worker's ack, as watermill's subscribers wait
// on a message they sent). It must not hang the attempt, holding its
// transaction open, and the handler's ack never reaches the delivery.
func TestHandlersMessageAckedChannelClosesOnAck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		acked, nacked := msg.Acked(), msg.Nacked()
		go msg.Ack() // the worker
		select {
		case <-acked:
			return nil, nil
		case <-nacked:
			return nil, errors.New("nacked")
		case <-time.After(5 * time.Second):
			return nil, errors.New("the handler's message was acked, its Acked channel never closed")
		}
	})
	delivery := newMsg(uuid.Must(uuid.NewV7()).String())
	_, err := h(delivery)
	require.NoError(t, err)
	select {
	case <-delivery.Acked():
		t.Fatal("the handler's ack reached the delivery")
	default:
	}
}
