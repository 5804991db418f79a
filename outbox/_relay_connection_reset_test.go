package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// resetDuring passes every publish to dest (a ConfirmedPublisher reaching
// RabbitMQ through rb.proxy) and, for the first `times` publishes to
// topic, resets the TCP connection while the message waits for its
// confirm (the proxy holds the bytes, then closes every connection; new
// connections go through at once): a network blip, a load balancer or a
// NAT dropping the connection, a broker node killed and back at once. It
// only triggers the fault: the error the relay sees is the publisher's.
type resetDuring struct {
	dest  message.Publisher
	rb    *rabbit
	topic string
	times int64
	n     atomic.Int64
}

func (r *resetDuring) Publish(topic string, msgs ...*message.Message) error {
	if topic == r.topic && r.n.Add(1) <= r.times {
		r.rb.proxy.Hang()
		go func() {
			time.Sleep(300 * time.Millisecond)
			r.rb.proxy.Cut()
			r.rb.proxy.Resume()
		}()
	}
	return r.dest.Publish(topic, msgs...)
}

func (r *resetDuring) Close() error { return nil }

// TestRelayConnectionResetDuringAConfirmIsNotTheRowsFault: a connection
// reset while a row waits for its confirm (a network blip, a load balancer
// or a NAT dropping the connection) is an outage, never the row's fault.
// amqp091 reports it as *amqp091.Error{Code: 501 FRAME_ERROR, Reason:
// "EOF", Server: false}; ConfirmedPublisher took every 501 for the broker
// refusing the message (headers over frame_max), the relay's probe then
// went through, and each reset counted against the row: after MaxAttempts
// resets a healthy row was dead-lettered. Only a 501 the broker sent is
// the message's now.
func TestRelayConnectionResetDuringAConfirmIsNotTheRowsFault(t *testing.T) {
	t.Run("Control", func(t *testing.T) { connectionResetDuringConfirm(t, 0) })
	t.Run("ThreeResets", func(t *testing.T) { connectionResetDuringConfirm(t, 3) })
}

func connectionResetDuringConfirm(t *testing.T, resets int64) {
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	probeQ, goodQ := rb.queue("probe"), rb.queue("good")
	id := b.writeEvent(t, goodQ)

	const maxAttempts = 3
	rec := &counts{}
	dest := &resetDuring{dest: rb.pub, rb: rb, topic: goodQ, times: resets}
	b.relay(t, dest, outbox.RelayConfig{MaxAttempts: maxAttempts, RetryInterval: 5 * time.Millisecond,
		MaxBackoff: 20 * time.Millisecond, ProbeTopic: probeQ, Recorder: rec})

	deadline := time.Now().Add(60 * time.Second)
	for {
		if got := rb.received(goodQ); len(got) > 0 {
			require.Equal(t, []string{id}, got)
			break
		}
		var reason string
		err := tg.DB.QueryRow(context.Background(), `SELECT reason FROM `+tg.Quote(b.table+"_dead")).Scan(&reason)
		if err == nil {
			t.Fatalf("a row whose only failures were %d connection resets (the broker up, the probe through) was dead-lettered; reason: %s", resets, reason)
		}
		if time.Now().After(deadline) {
			t.Fatalf("neither delivered nor dead-lettered; %d publishes to the queue", dest.n.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.Zero(t, rec.dead.Load())
}
