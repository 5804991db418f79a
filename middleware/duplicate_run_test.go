package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A replay (a stream re-read from an earlier offset, a relay republishing
// after a crash) delivers runs of events already processed that no broker
// marks as redelivered. Once most recent claims found duplicates, each
// duplicate is ended by one autocommit read of its row: no claim, no
// transaction, so a lock held on the claim table does not stop it. A
// conflicting payload is still a conflict. An event the read does not find
// is claimed as always (and waits on the lock), so it is applied once; once
// new events are the most again, a duplicate takes the claim too.
func TestDuplicatesOfAReplayAreEndedByAReadWithoutAClaim(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	ctx := context.Background()
	c, poison := consumerWithPoisonLog(t, e, func(cfg *middleware.ConsumerConfig) {
		cfg.LockTimeout = 100 * time.Millisecond
		cfg.Retry.MaxHold = 300 * time.Millisecond
	})
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", effectHandler(&calls))
	require.NoError(t, err)

	// First deliveries as AMQP and JetStream mark them (no crash count).
	delivery := func(id string, payload []byte) *message.Message {
		m := newEvent(t)
		if id != "" {
			m.UUID, m.Payload = id, payload
		}
		marshaler.SetRedelivered(m, false)
		marshaler.SetDeliveryCount(m, 0)
		return m
	}
	var events []*message.Message
	for range 30 {
		m := delivery("", nil)
		_, err := h(m)
		require.NoError(t, err)
		events = append(events, m)
	}
	for _, m := range events { // the replay
		_, err := h(delivery(m.UUID, m.Payload))
		require.NoError(t, err)
	}
	require.Equal(t, int32(30), calls.Load())

	// lockClaims holds the claim tables (the table and, where the store
	// claims UUIDv7 events there, <table>_v7) in mode until the returned
	// transaction ends: EXCLUSIVE lets reads on and makes every claim
	// wait, here past its LockTimeout; ACCESS EXCLUSIVE (DDL's) blocks
	// reads too.
	lockClaims := func(mode string) pgx.Tx {
		tx, err := e.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		var v7 bool
		require.NoError(t, tx.QueryRow(ctx, `SELECT to_regclass('processed_event_v7') IS NOT NULL`).Scan(&v7))
		tables := "processed_event"
		if v7 {
			tables += ", processed_event_v7"
		}
		_, err = tx.Exec(ctx, `LOCK TABLE `+tables+` IN `+mode+` MODE`)
		require.NoError(t, err)
		return tx
	}

	// A lock that blocks reads too: the duplicate's read gives up after
	// LockTimeout, as a claim would, and the attempt fails, held and
	// retried, instead of waiting for the lock without end.
	ddl := lockClaims("ACCESS EXCLUSIVE")
	done := make(chan error, 1)
	go func() { _, err := h(delivery(events[2].UUID, events[2].Payload)); done <- err }()
	select {
	case err := <-done:
		require.Error(t, err, "not acked while the tables are locked")
	case <-time.After(time.Minute): // a guard against a hang, not a speed check
		t.Fatal("the attempt waited on the lock past LockTimeout and MaxHold")
	}
	require.NoError(t, ddl.Rollback(ctx))

	lock := lockClaims("EXCLUSIVE")
	for _, m := range events[:10] {
		_, err := h(delivery(m.UUID, m.Payload))
		require.NoError(t, err, "a duplicate of the replay is acked without a claim")
	}
	_, err = h(delivery(events[0].UUID, []byte(`{"order_id":"o-2"}`)))
	require.NoError(t, err, "dead-lettered and acked")
	require.Equal(t, []string{events[0].UUID}, poison.poisoned(), "another payload under a processed id is a conflict")
	fresh := delivery("", nil)
	_, err = h(fresh)
	require.Error(t, err, "a new event during the replay is claimed, and its claim waits on the lock")
	require.Equal(t, int32(30), calls.Load())
	require.NoError(t, lock.Rollback(ctx))

	_, err = h(delivery(fresh.UUID, fresh.Payload))
	require.NoError(t, err)
	require.Equal(t, int32(31), calls.Load())
	for range 40 {
		_, err := h(delivery("", nil))
		require.NoError(t, err)
	}
	require.Equal(t, 71, e.effects(t), "each event applied once")

	lock = lockClaims("EXCLUSIVE")
	_, err = h(delivery(events[1].UUID, events[1].Payload))
	require.Error(t, err, "a duplicate among new events is claimed: the reads stopped with the replay")
	require.NoError(t, lock.Rollback(ctx))
	_, err = h(delivery(events[1].UUID, events[1].Payload))
	require.NoError(t, err)
	require.Equal(t, int32(71), calls.Load(), "the handler ran once per event")
}
