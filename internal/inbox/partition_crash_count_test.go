package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// On a partitioned transport that marks no redelivery (Kafka: the adapter
// sets each record's place, wire.Position) an attempt's crashes are counted
// in a start's first 64 attempts of new events and, after those, unless this
// process has just committed an attempt of a new event at the record before it
// in its partition (docs/guarantees.md). The record that killed the last
// member is the first record of its partition a restarted member attempts,
// however many records of other partitions come first: the first 64
// attempts alone missed it behind the first records of many partitions (a
// member owning 256 partitions under a steady producer was killed five times
// by a poisoned record that MaxCrashes 3 bounds).
// Whether an attempt is counted is read inside its handler: its row in
// processed_event_crash, written in autocommit before the attempt.
func TestPartitionedRecordIsCountedUnlessThisProcessHandledTheRecordBeforeIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	mw := e.mw(e.pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = sqldb.Pgx(e.pool)
	})
	var counted bool
	fail := errors.New("test: the handler fails")
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		counted = e.crashCount("stock", msg.UUID) == 1
		if msg.Metadata.Get("fail") != "" {
			return nil, fail
		}
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	deliver := func(id uuid.UUID, position string, failing bool) (ran, wasCounted bool) {
		t.Helper()
		msg, err := marshaler.NewMessageWithID(id, "order.placed", time.Now().UTC(), map[string]int{"qty": 1})
		require.NoError(t, err)
		msg.Metadata.Set(wire.Position, position)
		if failing {
			msg.Metadata.Set("fail", "1")
		}
		msg.SetContext(context.Background())
		counted = false
		before := e.count(`SELECT count(*) FROM effect`)
		_, err = h(msg)
		if failing {
			require.ErrorIs(t, err, fail)
		} else {
			require.NoError(t, err)
		}
		// Every attempt that ended ended its count.
		require.Equal(t, 0, e.crashCount("stock", msg.UUID), "the count of %s at %s outlived its attempt", id, position)
		return failing || e.count(`SELECT count(*) FROM effect`) > before, counted
	}
	newEvent := func(position string) bool {
		t.Helper()
		ran, c := deliver(uuid.Must(uuid.NewV7()), position, false)
		require.True(t, ran, "the event at %s was not applied", position)
		return c
	}

	// A start: the first record of each of 100 partitions is counted, the
	// 65th to 100th too, past the warm-up.
	for p := 0; p < 100; p++ {
		require.True(t, newEvent(fmt.Sprintf("orders/%d/5", p)), "the first record of partition %d after the start was not counted", p)
	}
	// The next record of a partition follows the one this process ended.
	require.False(t, newEvent("orders/7/6"), "a record right after one this process handled was counted")
	require.False(t, newEvent("orders/7/7"))

	// A duplicate marks nothing: the record before the next one may have been
	// another member's (a replay after a reassignment), so that one counts.
	dup := uuid.Must(uuid.NewV7())
	ran, _ := deliver(dup, "orders/8/6", false)
	require.True(t, ran)
	ran, _ = deliver(dup, "orders/7/8", false)
	require.False(t, ran, "a duplicate ran its handler")
	require.True(t, newEvent("orders/7/9"), "the record after a duplicate was not counted")
	require.False(t, newEvent("orders/7/10"))

	// A gap (a reassignment, a transaction's marker) and a rewind count.
	require.True(t, newEvent("orders/7/20"), "the record after a gap was not counted")
	require.True(t, newEvent("orders/7/3"), "a record behind the last one handled was not counted")

	// A failed attempt ended in this process: the same record given back
	// (the chain's retry, a nack after a hold) is counted, since that
	// attempt may be the one that dies; the one after it follows.
	again := uuid.Must(uuid.NewV7())
	_, c := deliver(again, "orders/9/6", true)
	require.False(t, c, "the record after one this process handled was counted")
	_, c = deliver(again, "orders/9/6", false)
	require.True(t, c, "the same record given back after its attempt ended was not counted")
	require.False(t, newEvent("orders/9/7"))

	// Another topic's partition of the same number is another partition.
	require.True(t, newEvent("payments/7/11"))
}
