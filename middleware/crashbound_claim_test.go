package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A redelivery over the crash bound whose claim fails (here: it waits out
// the lock timeout on a claim another copy holds, and that copy's process
// then dies) is retried as a redelivery over the bound: the failed claim
// ends no crash, so the crashes counted before it are kept, and the retry
// dead-letters the message as a crash loop once its claim gets through.
// The handler of a message that kept killing the process never runs again.
func TestRedeliveryOverTheCrashBoundWhoseClaimFailsKeepsItsCrashCount(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	c, poison := consumerWithPoisonLog(t, e, func(cfg *middleware.ConsumerConfig) { cfg.LockTimeout = 50 * time.Millisecond })
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", countingHandler(&calls))
	require.NoError(t, err)

	msg := newEvent(t)
	_, err = e.pool.Exec(ctx, `INSERT INTO processed_event_crash (consumer, event_id, started) VALUES ('stock', $1, 10)`, msg.UUID)
	require.NoError(t, err)
	// Another copy holds the claim, in a handler that is about to kill
	// its process: its transaction ends without a commit.
	holder, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = holder.Exec(ctx, `INSERT INTO processed_event (consumer, event_id) VALUES ('stock', $1)`, msg.UUID)
	require.NoError(t, err)
	var die sync.Once
	rollback := func() { die.Do(func() { _ = holder.Rollback(ctx) }) }
	time.AfterFunc(300*time.Millisecond, rollback)
	t.Cleanup(rollback) // before the schema is dropped

	marshaler.SetRedelivered(msg, true)
	_, err = h(msg)
	require.NoError(t, err, "dead-lettered and acked")
	require.Zero(t, calls.Load(), "the handler of a message over the crash bound never runs")
	require.Equal(t, []string{msg.UUID}, poison.poisoned(), "dead-lettered as a crash loop")
}

// downPublisher is a poison publisher that fails while down, as a
// dead-letter destination that is away (a missing exchange, a blocked
// connection), then keeps what it is given once up.
type downPublisher struct {
	down atomic.Bool
	poisonLog
}

func (p *downPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.down.Load() {
		return errors.New("test: the poison destination is away")
	}
	return p.poisonLog.Publish(topic, msgs...)
}

// A redelivery over the crash bound is rejected as a crash loop; when its
// poison publish keeps failing until MaxHold, the delivery is given back to
// the broker (nack), not acked. Its next delivery is still over the bound:
// the crashes counted before it are kept until the message is dead-lettered,
// and the handler of a message that kept killing the process never runs
// again because the dead-letter destination was away for a while.
func TestCrashLoopWhosePoisonPublishFailsIsStillOverTheBoundWhenRedelivered(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	poison := &downPublisher{}
	poison.down.Store(true)
	cfg := e.config("stock")
	cfg.Poison.Publisher = poison
	cfg.Retry.MaxHold = 200 * time.Millisecond
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", countingHandler(&calls))
	require.NoError(t, err)

	msg := newEvent(t)
	// Four attempts of it died: over the bound (MaxCrashes 3).
	_, err = e.pool.Exec(ctx, `INSERT INTO processed_event_crash (consumer, event_id, started) VALUES ('stock', $1, 4)`, msg.UUID)
	require.NoError(t, err)
	marshaler.SetRedelivered(msg, true)
	_, err = h(msg)
	require.Error(t, err, "the poison publish failed until MaxHold: nacked, not acked")
	require.Zero(t, calls.Load())
	require.Empty(t, poison.poisoned())

	// The broker delivers it again; the dead-letter destination is back.
	poison.down.Store(false)
	again := newEvent(t)
	again.UUID, again.Payload = msg.UUID, msg.Payload
	marshaler.SetRedelivered(again, true)
	_, err = h(again)
	require.NoError(t, err, "dead-lettered and acked")
	require.Zero(t, calls.Load(), "the handler of a message over the crash bound never runs")
	require.Equal(t, []string{msg.UUID}, poison.poisoned(), "dead-lettered as a crash loop")
}

// A consumer whose table lacks <table>_crash (migrated by a release before
// processed migration 0006, or by a tool that skipped it) would count no
// attempt: every start fails, each redelivery runs uncounted with nothing
// logged, and a message that kills the process is never dead-lettered
// (MaxCrashes is on by default). NewConsumer refuses it, as it refuses a
// missing table, naming processed.Migrate.
func TestConsumerRefusesATableWithoutItsCrashCountTable(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	_, err := e.pool.Exec(context.Background(), `DROP TABLE processed_event_crash`)
	require.NoError(t, err)
	_, err = middleware.NewConsumer(e.config("stock"), nil)
	require.Error(t, err, "the crash bound (MaxCrashes, on by default) cannot count on this table")
	require.ErrorContains(t, err, "processed_event_crash")
	require.ErrorContains(t, err, "Migrate")

	cfg := e.config("stock")
	cfg.MaxCrashes = -1 // no bound: nothing to count
	_, err = middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
}
