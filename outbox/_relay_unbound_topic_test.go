package outbox_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// The README's producer quick start: a confirmed, mandatory publisher and
// the default probe topic, and the promise next to it: "a row whose topic
// no queue is bound to yet stays in the outbox". A service producing two
// topics, one whose consumer already bound its queue (published steadily)
// and one whose consumer is not deployed yet: the second topic's row must
// stay in the outbox until its queue exists, then be delivered. It is
// dead-lettered instead, after MaxAttempts rounds in which a row of the
// other topic went through.
func TestRelayRabbitMQRowOfUnboundTopicKeptWhileOtherTopicsFlow(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	placed := rb.queue("placed")
	cancelled := testenv.UniqueName("cancelled") // its consumer is not deployed yet

	rec := &counts{}
	b.relay(t, rb.pub, outbox.RelayConfig{MaxAttempts: 3, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Recorder: rec})
	early := b.writeEvent(t, cancelled)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the other topic's steady traffic
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				b.writeEvent(t, placed)
			}
		}
	}()
	time.Sleep(5 * time.Second)
	close(stop)
	wg.Wait()
	require.NotEmpty(t, rb.received(placed), "the bound topic flows")
	require.Zero(t, rec.dead.Load(), "the row of the topic with no queue yet is dead-lettered instead of kept")

	_, err := rb.ch.QueueDeclare(cancelled, false, false, false, false, nil) // its consumer arrives
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = rb.ch.QueueDelete(cancelled, false, false, false) })
	var got []string
	eventually(t, 60*time.Second, func() bool { got = append(got, rb.received(cancelled)...); return len(got) >= 1 }, "the kept row delivered once its queue exists")
	require.Equal(t, []string{early}, got)
}
