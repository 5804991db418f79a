package inbox_test

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

type recordingDLQ struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *recordingDLQ) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *recordingDLQ) Close() error { return nil }
func (p *recordingDLQ) n() int       { p.mu.Lock(); defer p.mu.Unlock(); return len(p.msgs) }

func (p *recordingDLQ) last() *message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.msgs[len(p.msgs)-1]
}

// A dead letter redriven by hand on a transport idem dlq redrive does not
// serve (JetStream, Kafka, Redis Streams: consume the DLQ, Publish the
// message to its topic_poisoned with the transport's Publisher, which keeps
// its metadata) and that still fails goes back to the dead-letter queue,
// and the consumer moves on, however soon after its poisoning it was
// redriven. Holding every message that carried poison headers held it for
// ever (MaxHold, nack, redelivery, hold...), and every later message of
// the subscription waited behind it.
func TestRedrivenDeadLetterThatFailsAgainDoesNotStallTheConsumer(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	dlq := &recordingDLQ{}
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store: e.store, Consumer: "stock"}, nil)
	require.NoError(t, err)
	var good atomic.Int32
	pubsub := ordersChain(t, idem, logger, 100*time.Millisecond, func(*gochannel.GoChannel) message.Publisher { return dlq },
		func(m *message.Message) error {
			if m.Metadata.Get("kind") == "bad" {
				return errors.New("handler bug")
			}
			good.Add(1)
			return nil
		})
	require.NoError(t, pubsub.Publish("orders", kindMsg("bad")))
	require.Eventually(t, func() bool { return dlq.n() == 1 }, 10*time.Second, 10*time.Millisecond, "dead-lettered once: %v", logger.at("error", ""))

	// Redrive by hand: the dead letter as consumed from the DLQ, published to its topic_poisoned.
	dl := dlq.last()
	require.Equal(t, "orders", dl.Metadata.Get("topic_poisoned"))
	redriven := message.NewMessage(dl.UUID, dl.Payload)
	redriven.Metadata = dl.Metadata
	require.NoError(t, pubsub.Publish(dl.Metadata.Get("topic_poisoned"), redriven))
	require.NoError(t, pubsub.Publish("orders", kindMsg("good")))

	require.Eventually(t, func() bool { return dlq.n() == 2 && good.Load() == 1 }, 30*time.Second, 10*time.Millisecond,
		"the redriven copy that failed again is back in the DLQ and the next message was processed (held ERROR logged %d times)",
		len(logger.at("error", "Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held")))
	require.Equal(t, "2", dlq.last().Metadata.Get(inbox.MetadataPoisonCount), "poisoned twice")
	require.Empty(t, logger.at("error", "Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held"))
}

func kindMsg(kind string) *message.Message {
	m := newMsg(uuid.Must(uuid.NewV7()).String())
	m.Metadata.Set("kind", kind)
	return m
}
