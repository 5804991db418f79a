package outbox_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// cutAfter publishes through dest and, once a publish to topic went
// through, makes the broker unreachable (the fault proxy refuses every
// connection): an outage that begins in the middle of a relay round.
type cutAfter struct {
	dest  message.Publisher
	topic string
	cut   func()
	done  atomic.Bool
}

func (c *cutAfter) Publish(topic string, msgs ...*message.Message) error {
	err := c.dest.Publish(topic, msgs...)
	if err == nil && topic == c.topic && c.done.CompareAndSwap(false, true) {
		c.cut()
	}
	return err
}

func (c *cutAfter) Close() error { return nil }

// RabbitMQ becomes unreachable in the middle of a round: the round's first
// row went through, the next one (another topic, nothing wrong with it)
// fails to connect. producer.md: "an outage never counts" and "neither an
// outage nor back-pressure of any length dead-letters anything". The
// second row is counted against MaxAttempts all the same (the broker
// "took something in the same round", before it went away), and with
// MaxAttempts 1 it is dead-lettered by the outage (with the default, each
// outage that begins mid-round spends one of a healthy row's attempts).
func TestRelayRabbitMQOutageBeginningMidRoundDeadLettersNothing(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	probeQ, qa, qb := rb.queue("probe"), rb.queue("a"), rb.queue("b")
	first := b.writeEvent(t, qa)
	second := b.writeEvent(t, qb)

	dest := &cutAfter{dest: rb.pub, topic: qa, cut: func() { rb.proxy.Refuse(time.Hour) }}
	rec := &counts{}
	b.relay(t, dest, outbox.RelayConfig{MaxAttempts: 1, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return dest.done.Load() && (rec.failed.Load() >= 3 || rec.dead.Load() > 0) }, "the outage began after the first row; the second keeps failing")
	require.Equal(t, []string{first}, rb.received(qa))
	require.Zero(t, rec.dead.Load(), "the row that failed because the broker went away is not dead-lettered")

	rb.proxy.Restore()
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(qb)...); return len(got) >= 1 }, "the second row delivered after the outage")
	require.Equal(t, []string{second}, got)
}
