package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// unroutableErr is a publish error with Unroutable() true (no queue bound).
type unroutableErr struct{}

func (unroutableErr) Error() string    { return "no route" }
func (unroutableErr) Unroutable() bool { return true }

// A row waiting for its retry holds back only the later rows of its own
// topic: topics are the broker's routing keys and subjects, compared
// exactly ("Orders" and "orders" are two topics on RabbitMQ and NATS).
func TestRelayWaitingRowHoldsBackOnlyItsExactTopic(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		b := newBox(t, tg)
		stuck, other := newID(), newID()
		b.write(t, "Orders", stuck)
		s := &sink{refuse: func(topic string, _ *message.Message) error {
			if topic == "Orders" {
				return unroutableErr{}
			}
			return nil
		}}
		b.relay(t, s, outbox.RelayConfig{RetryInterval: time.Hour, MaxBackoff: time.Hour})
		eventually(t, 30*time.Second, func() bool { return b.nextTry(t) != 0 }, "the Orders row waits for its retry")
		b.write(t, "orders", other)
		deadline := time.Now().Add(5 * time.Second)
		for s.count(other) == 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		require.Equal(t, 1, s.count(other), "the row of topic \"orders\" is held back by a waiting row of topic \"Orders\"")
	})
}
