package middleware_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// poisonLog is a poison publisher that keeps the UUID of every message
// dead-lettered through it, in order, as the poison layer publishes it
// (before the handler returns).
type poisonLog struct {
	mu    sync.Mutex
	uuids []string
}

func (p *poisonLog) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.uuids = append(p.uuids, m.UUID)
	}
	return nil
}

func (p *poisonLog) Close() error { return nil }

func (p *poisonLog) poisoned() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.uuids...)
}

// A redelivery of an event already processed is acked without calling the
// handler and counts no attempt; a count an earlier release left behind
// (its process died after the commit, before the count's end, which it
// wrote after the commit) is never taken for a crash loop: the effect was
// applied, so the message is a duplicate, not poison.
func TestRedeliveredProcessedEventIsADuplicateWhateverItsCrashCount(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	c, poison := consumerWithPoisonLog(t, e)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", effectHandler(&calls))
	require.NoError(t, err)

	msg := newEvent(t)
	marshaler.SetRedelivered(msg, false)
	marshaler.SetDeliveryCount(msg, 0)
	_, err = h(msg)
	require.NoError(t, err)
	require.Equal(t, int32(1), calls.Load())

	// Attempts that died after their commit left a count above the bound.
	redeliverOverTheCrashBound(t, e, h, msg, poison)
	require.Equal(t, int32(1), calls.Load(), "the handler is not called for a duplicate")
}

// consumerWithPoisonLog is the env's "stock" consumer, dead-lettering
// through a poisonLog, with edits applied to its config.
func consumerWithPoisonLog(t *testing.T, e consumerEnv, edits ...func(*middleware.ConsumerConfig)) (*middleware.Consumer, *poisonLog) {
	t.Helper()
	poison := &poisonLog{}
	cfg := e.config("stock")
	cfg.Poison.Publisher = poison
	for _, edit := range edits {
		edit(&cfg)
	}
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	return c, poison
}

// countingHandler is a handler that counts its calls and does nothing else.
func countingHandler(calls *atomic.Int32) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	}
}

// effectHandler is a handler that counts its calls and writes one effect
// row in the attempt's transaction.
func effectHandler(calls *atomic.Int32) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	}
}

// redeliverOverTheCrashBound redelivers processed (its one effect applied)
// through h with a crash count of 10 left behind, and checks it is acked as
// a duplicate: no second effect, no dead letter, no attempt counted.
func redeliverOverTheCrashBound(t *testing.T, e consumerEnv, h message.HandlerFunc, processed *message.Message, poison *poisonLog) {
	t.Helper()
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `INSERT INTO processed_event_crash (consumer, event_id, started) VALUES ('stock', $1, 10)`, processed.UUID)
	require.NoError(t, err)
	again := newEvent(t)
	again.UUID, again.Payload = processed.UUID, processed.Payload
	marshaler.SetRedelivered(again, true)
	_, err = h(again)
	require.NoError(t, err, "acked")
	require.Equal(t, 1, e.effects(t), "no second effect")
	require.Empty(t, poison.poisoned(), "a processed event is never dead-lettered as a crash loop")
	var left int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT coalesce(max(started), 0) FROM processed_event_crash`).Scan(&left))
	require.LessOrEqual(t, left, 10, "no attempt is counted")
}

// A redelivery that reuses a processed event's id for other content is a
// conflict (reason event_id_reused), as on a first delivery: the stored
// fingerprint is compared on the redelivery's path too.
func TestRedeliveredEventWithAnotherPayloadIsAConflict(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	c, poison := consumerWithPoisonLog(t, e)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", countingHandler(&calls))
	require.NoError(t, err)
	msg := newEvent(t)
	_, err = h(msg)
	require.NoError(t, err)

	other := newEvent(t)
	other.UUID, other.Payload = msg.UUID, []byte(`{"order_id":"o-2"}`)
	marshaler.SetRedelivered(other, true)
	_, err = h(other)
	require.NoError(t, err, "dead-lettered and acked")
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, []string{msg.UUID}, poison.poisoned(), "the conflicting redelivery is dead-lettered")
	var left int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left)
}

// An event processed before the table moved to the partitioned layout
// (processed.MigrateToPartitioned) has its row in <table>_legacy, which only
// the claim consults: a redelivery of it whose attempts left a count above
// the bound is still a duplicate, found by the claim before the crash bound
// dead-letters anything, and the count is deleted.
func TestRedeliveredEventProcessedBeforeThePartitionSwitchIsADuplicateWhateverItsCrashCount(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	poison := &poisonLog{}
	cfg := e.config("stock")
	cfg.Poison.Publisher = poison
	var calls atomic.Int32
	handler := effectHandler(&calls)
	plain, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	h, err := door.Wrap(plain, "reserve", handler)
	require.NoError(t, err)
	msg := newEvent(t)
	_, err = h(msg)
	require.NoError(t, err)
	require.Equal(t, int32(1), calls.Load())

	require.NoError(t, processed.MigrateToPartitioned(ctx, e.db, processed.Config{}))
	cfg.Layout = processed.LayoutPartitioned
	part, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	h, err = door.Wrap(part, "reserve", handler)
	require.NoError(t, err)
	var legacy int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_legacy WHERE event_id = $1`, msg.UUID).Scan(&legacy))
	require.Equal(t, 1, legacy, "the processed row is in the legacy table")

	redeliverOverTheCrashBound(t, e, h, msg, poison)
	require.Equal(t, int32(1), calls.Load(), "the handler is not called for a duplicate")
}
