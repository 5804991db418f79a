package inbox_test

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// flakyPoisonTopic is a poison topic that is down (connection refused)
// for its first `down` publishes, then up: a momentary outage. It has no
// size limit at all (RabbitMQ takes bodies up to 128 MiB; NATS and Kafka
// 1 MiB), so no copy is ever refused for its size.
type flakyPoisonTopic struct {
	mu    sync.Mutex
	down  int
	tries int
	got   []*message.Message
}

func (s *flakyPoisonTopic) Publish(_ string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.tries++
		if s.tries <= s.down {
			return errors.New("dial tcp 127.0.0.1:5672: connect: connection refused")
		}
		s.got = append(s.got, m)
	}
	return nil
}
func (s *flakyPoisonTopic) Close() error { return nil }

// docs/guarantees.md: "The original is acked only after the poison publish
// returned nil; a failed poison publish is retried with backoff", and an
// outage of the poison topic is a wait, never a loss. A well-formed event
// of 100 KiB whose handler failed permanently meets a poison topic that
// refused two publishes with "connection refused" and is back for the
// third: the dead letter carries the event's payload. (The copy without
// its payload is only for a copy refused for its size twice in a row.)
func TestPoisonTopicMomentaryOutageKeepsThePayload(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	topic := &flakyPoisonTopic{down: 2}
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: topic, PoisonTopic: "stock.dlq",
		InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxHold: time.Hour,
	}, nil)
	require.NoError(t, err)
	var h message.HandlerFunc = func(msg *message.Message) ([]*message.Message, error) {
		return nil, inbox.Permanent(errors.New("order unknown"))
	}
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}

	payload := []byte(`{"note":"` + strings.Repeat("x", 100<<10) + `"}`)
	ev := message.NewMessage("01906dbc-ad00-70a1-8a1b-7e7e7e7e0001", payload)
	ev.Metadata.Set("idempotency_event_name", "order.placed")
	_, err = h(ev)
	require.NoError(t, err, "acked once dead-lettered")

	topic.mu.Lock()
	defer topic.mu.Unlock()
	require.Len(t, topic.got, 1)
	dl := topic.got[0]
	t.Logf("publishes: %d; dead letter: %d bytes of payload, idempotency_payload_omitted=%q, idempotency_malformed=%q",
		topic.tries, len(dl.Payload), dl.Metadata.Get(inbox.MetadataPayloadOmitted), dl.Metadata.Get("idempotency_malformed"))
	require.Empty(t, dl.Metadata.Get(inbox.MetadataPayloadOmitted),
		"a poison topic down for two publishes (connection refused) is an outage, not a size refusal: the payload was dropped")
	require.Equal(t, payload, []byte(dl.Payload), "the only dead letter of an acked event must carry its payload")
}
