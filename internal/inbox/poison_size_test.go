package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// sizeLimitedTopic is a poison topic that refuses a message whose payload
// and metadata add up to more than limit bytes (Kafka's producer
// MaxMessageBytes, NATS max_payload), or every message while down.
type sizeLimitedTopic struct {
	limit int
	mu    sync.Mutex
	down  bool
	tries int
	got   []*message.Message
}

func (s *sizeLimitedTopic) Publish(_ string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.tries++
		if s.down {
			return errors.New("poison topic: connection refused")
		}
		n := len(m.Payload)
		for k, v := range m.Metadata {
			n += len(k) + len(v)
		}
		if n > s.limit {
			return fmt.Errorf("poison topic: message of %d bytes over the limit of %d: %w", n, s.limit, errMaxPayload)
		}
		s.got = append(s.got, m)
	}
	return nil
}
func (s *sizeLimitedTopic) Close() error { return nil }

// errMaxPayload has nats.go's text for a message over max_payload.
var errMaxPayload = errors.New("nats: maximum payload exceeded")

// A failed message whose poisoned copy the poison topic can never take
// (its payload just under the transport's limit, plus the poison headers:
// a Kafka record of 1,048,000 bytes) is dead-lettered without its payload,
// flagged malformed, with idempotency_payload_omitted giving the size and
// the refusal, and acked: before, every publish failed, the delivery was
// held, nacked and redelivered for ever, and its partition never moved on.
// A poison topic that is down takes neither copy: the delivery is held.
func TestPoisonCopyOverThePoisonTopicsSizeLimitIsDeadLetteredWithoutItsPayload(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	chainWith := func(topic *sizeLimitedTopic, maxHold time.Duration) message.HandlerFunc {
		chain, err := inbox.NewChain(inbox.ChainConfig{
			Idempotent: idem, PoisonPublisher: topic, PoisonTopic: "dlq",
			InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond, MaxHold: maxHold,
		}, nil)
		require.NoError(t, err)
		var h message.HandlerFunc = func(*message.Message) ([]*message.Message, error) {
			t.Error("the handler ran for a malformed message")
			return nil, nil
		}
		for i := len(chain) - 1; i >= 0; i-- {
			h = chain[i](h)
		}
		return h
	}
	// A foreign record just under the limit: the decoder flags it malformed.
	big := marshaler.NewMalformed([]byte(strings.Repeat("x", limit-100)), "orders/0/42", "envelope: not JSON")

	topic := &sizeLimitedTopic{limit: limit}
	_, err = chainWith(topic, 5*time.Second)(big)
	require.NoError(t, err, "acked once dead-lettered")
	require.Len(t, topic.got, 1)
	dl := topic.got[0]
	require.Empty(t, dl.Payload)
	require.Equal(t, big.UUID, dl.UUID)
	omitted := dl.Metadata.Get(inbox.MetadataPayloadOmitted)
	require.True(t, strings.HasPrefix(omitted, fmt.Sprintf("%d bytes; the poison topic refused the whole copy: ", limit-100)), omitted)
	require.Contains(t, omitted, "maximum payload exceeded")
	require.Contains(t, dl.Metadata.Get(wmw.ReasonForPoisonedKey), "malformed")
	reason, flagged := marshaler.Malformed(dl)
	require.True(t, flagged)
	require.Equal(t, "envelope: not JSON", reason, "the original's malformed reason is kept")

	// The poison topic down: neither copy is taken, the delivery is held
	// and given back when the message context ends, never acked.
	down := &sizeLimitedTopic{limit: limit, down: true}
	ctx, cancel := context.WithCancel(context.Background())
	big2 := marshaler.NewMalformed([]byte(strings.Repeat("y", limit-100)), "orders/0/43", "envelope: not JSON")
	big2.SetContext(ctx)
	h := chainWith(down, time.Hour)
	done := make(chan error, 1)
	go func() { _, err := h(big2); done <- err }()
	for {
		down.mu.Lock()
		tries := down.tries
		down.mu.Unlock()
		if tries >= 6 { // full, full + without payload, full + without payload, …
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	err = <-done
	require.Error(t, err)
	require.ErrorIs(t, err, inbox.ErrInfrastructure, "given back (nack), not acked")
	require.Empty(t, down.got)
}
