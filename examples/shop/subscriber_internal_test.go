package shop

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A delivery the marshaler cannot decode is rejected without requeue: the
// broker dead-letters it, it never loops.
func TestSubscriberRejectsUndecodable(t *testing.T) {
	t.Parallel()
	c := Consumer{Name: "stock", Bindings: []string{EventOrderPlaced}}
	topo := Topology{Prefix: testenv.UniqueName("sub") + "."}
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = topo.Delete(ch, c)
		}
		_ = conn.Close()
	})
	sub, err := topo.NewSubscriber(testenv.AMQPURL(), c, nil)
	require.NoError(t, err)
	sub.unmarsh = errUnmarshaler{}
	msgs, err := sub.Subscribe(context.Background(), "")
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.PublishWithContext(context.Background(), topo.ExchangeName(), EventOrderPlaced, false, false, amqp091.Publishing{Body: []byte("x")}))
	testenv.Eventually(t, 10*time.Second, "one message dead-lettered", func(o *testenv.Observed) bool {
		q, err := ch.QueueDeclarePassive(topo.DeadLetterQueue(c), true, false, false, false, nil)
		return o.Err("err", err) && o.Int("ready(dlq)", q.Messages) == 1
	})
	select {
	case m := <-msgs:
		t.Fatalf("an undecodable delivery reached the router: %v", m)
	default:
	}
}

// errUnmarshaler is a marshaler whose Unmarshal always fails (which
// amqpmarshaler.Marshaler never does).
type errUnmarshaler struct{}

func (errUnmarshaler) Marshal(*message.Message) (amqp091.Publishing, error) {
	return amqp091.Publishing{}, nil
}

func (errUnmarshaler) Unmarshal(amqp091.Delivery) (*message.Message, error) {
	return nil, errors.New("cannot decode")
}
