package idempotencytest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// The copies DeliverConcurrently delivers are first deliveries (as several
// consumers receive them), not redeliveries: the crash bound
// (ConsumerConfig.MaxCrashes, default 3) counted the unmarked copies still
// waiting on the winner's claim as attempts that died, and dead-lettered
// the copies past the third as crash_loop while the helper reported
// success. With 8 copies on PostgreSQL, the 7 losing copies skip as
// duplicates and none reaches the poison topic; and a copy the chain
// poisons anyway is reported through t.
func TestDeliverConcurrentlyLosingCopiesSkipAndAreNotDeadLettered(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	poisoned, err := f.poison.Subscribe(context.Background(), "poison")
	require.NoError(t, err)
	c := f.consumer(t, "copies")
	s := f.subject(c)
	s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
		time.Sleep(200 * time.Millisecond) // the losing copies wait on the claim meanwhile
		return f.handler(msg)
	})
	tb := &fakeTB{}
	msg := newMsg()
	r := idempotencytest.DeliverConcurrently(tb, s, msg, 8)
	require.Empty(t, tb.all())
	require.Equal(t, 1, r.Calls)
	require.Equal(t, 1, r.Effects)
	require.Empty(t, r.Poisoned)
	select {
	case p := <-poisoned:
		p.Ack()
		t.Fatalf("a copy was dead-lettered: %s", p.Metadata.Get("reason_poisoned"))
	case <-time.After(200 * time.Millisecond):
	}
	require.Empty(t, msg.Metadata.Get("redelivered"), "the caller's message is left as it was")

	t.Run("a poisoned copy is reported", func(t *testing.T) {
		s := f.subject(c)
		s.Handler = idempotencytest.NoPublish(func(*message.Message) error {
			return middleware.Permanent(errors.New("bad payload"))
		})
		tb := &fakeTB{}
		r := idempotencytest.DeliverConcurrently(tb, s, newMsg(), 2)
		require.Len(t, r.Poisoned, 2, "each copy failed and was poisoned, none returned an error")
		require.Empty(t, r.Errors)
		require.Contains(t, tb.all(), "was poisoned")
		require.Contains(t, tb.all(), "bad payload")
		for range r.Poisoned {
			(<-poisoned).Ack()
		}
	})
}
