package shop_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
)

func receive(t *testing.T, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m := <-msgs:
		require.NotNil(t, m)
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery")
		return nil
	}
}

func waitQueued(t *testing.T, b *shop.ChannelBroker, c shop.Consumer, want int) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("%d messages queued for %s", want, c.Name), func(o *testenv.Observed) bool {
		n, err := b.Queued(c)
		return o.Err("err", err) && o.Int("queued", n) == want
	})
}

// The channel broker behaves like the RabbitMQ queue for what the demo
// relies on: fan-out by event name, requeue on nack, redelivery on a new
// session after a cut lost the ack, malformed bodies flagged by the
// marshaler, dead letters kept with their reason.
func TestChannelBroker(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := shop.NewChannelBroker(nil)
	defer b.Close()
	other := shop.Consumer{Name: "shipping", Bindings: []string{shop.EventOrderPlaced, shop.EventOrderStatusChanged}}
	require.NoError(t, b.Declare(consumer, other))

	sub, err := b.Subscriber(consumer, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "ignored")
	require.NoError(t, err)

	ev, err := marshaler.NewMessage(shop.EventOrderPlaced, map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	require.NoError(t, b.Publisher().Publish(shop.EventOrderPlaced, ev))
	status, err := marshaler.NewMessage(shop.EventOrderStatusChanged, map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	require.NoError(t, b.Publisher().Publish(shop.EventOrderStatusChanged, status))
	waitQueued(t, b, other, 2) // both bound there, only the first here

	// Nack: requeued, redelivered=true, same session.
	m := receive(t, msgs)
	require.Equal(t, ev.UUID, m.UUID)
	require.Equal(t, string(ev.Payload), string(m.Payload))
	require.False(t, marshaler.Redelivered(m))
	s1, ok := shop.SessionFromContext(m.Context())
	require.True(t, ok)
	m.Nack()
	m = receive(t, msgs)
	require.Equal(t, ev.UUID, m.UUID)
	require.True(t, marshaler.Redelivered(m))
	s2, _ := shop.SessionFromContext(m.Context())
	require.Equal(t, s1, s2, "a requeue is not a new connection")

	// Cut: the ack is lost, the message comes again on a new session.
	b.Cut(consumer)
	m.Ack()
	m = receive(t, msgs)
	require.Equal(t, ev.UUID, m.UUID)
	require.True(t, marshaler.Redelivered(m))
	s3, _ := shop.SessionFromContext(m.Context())
	require.NotEqual(t, s2, s3)
	m.Ack()
	waitQueued(t, b, consumer, 0)

	// A malformed body reaches the consumer flagged, with its message id,
	// and its poison publish lands in the dead letters with the reason.
	require.NoError(t, b.PublishRaw(shop.EventOrderPlaced, "malformed-1", []byte(`{"event_id":`)))
	m = receive(t, msgs)
	_, bad := marshaler.Malformed(m)
	require.True(t, bad)
	require.Equal(t, "malformed-1", m.UUID)
	poison, topic, err := b.PoisonPublisher(consumer, nil)
	require.NoError(t, err)
	dead := m.Copy()
	dead.Metadata.Set(wmw.ReasonForPoisonedKey, "malformed")
	require.NoError(t, poison.Publish(topic, dead))
	m.Ack()
	waitQueued(t, b, consumer, 0)
	letters, err := b.DrainDeadLetters(consumer)
	require.NoError(t, err)
	require.Len(t, letters, 1)
	require.Equal(t, "malformed-1", letters[0].MessageID)
	require.Equal(t, "malformed", letters[0].Headers[wmw.ReasonForPoisonedKey])
	letters, err = b.DrainDeadLetters(consumer)
	require.NoError(t, err)
	require.Empty(t, letters)

	// An event name no queue binds is dropped; an undeclared consumer is an error.
	require.NoError(t, b.Publisher().Publish("nobody.listens.v1", ev))
	_, err = b.Queued(shop.Consumer{Name: "billing", Bindings: []string{"x"}})
	require.Error(t, err)
}

// The outbox on SQLite: rows written in a transaction exist only if it
// commits, the relay publishes them in commit order with their event ids,
// and leaves nothing pending.
func TestSQLiteOutbox(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db := shop.SQLiteDB(testenv.SQLiteDB(t))
	ob, err := db.Outbox("order_outbox", nil)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))

	var kept []string
	write := func(commit bool) {
		tx, err := db.SQL.BeginTx(ctx, nil)
		require.NoError(t, err)
		pub, err := ob.StdPublisher(tx)
		require.NoError(t, err)
		m, err := marshaler.NewMessage(shop.EventOrderPlaced, map[string]string{"order_id": "o-1"})
		require.NoError(t, err)
		m.SetContext(ctx)
		require.NoError(t, pub.Publish(shop.EventOrderPlaced, m))
		if commit {
			require.NoError(t, tx.Commit())
			kept = append(kept, m.UUID)
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	write(true)
	write(false)
	write(true)
	write(true)
	n, err := shop.OutboxPending(ctx, db, ob)
	require.NoError(t, err)
	require.Equal(t, 3, n)

	b := shop.NewChannelBroker(nil)
	defer b.Close()
	require.NoError(t, b.Declare(consumer))
	relay, err := ob.NewRelay(b.Publisher(), outbox.RelayConfig{
		PollInterval: 10 * time.Millisecond,
	})
	require.NoError(t, err)
	go func() { _ = relay.Run(ctx) }()
	defer relay.Close()

	sub, err := b.Subscriber(consumer, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "")
	require.NoError(t, err)
	for _, id := range kept {
		m := receive(t, msgs)
		require.Equal(t, id, m.UUID)
		m.Ack()
	}
	testenv.Eventually(t, 10*time.Second, "the outbox relayed", func(o *testenv.Observed) bool {
		n, err := shop.OutboxPending(ctx, db, ob)
		return o.Err("err", err) && o.Int("pending", n) == 0
	})
}

// A service on SQLite and the channel broker: an event published twice, whose
// first delivery's ack a cut loses after the commit, has one effect.
func TestServiceEmbedded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sqlDB := testenv.SQLiteDB(t)
	db := shop.SQLiteDB(sqlDB)
	require.NoError(t, db.Exec(ctx, `CREATE TABLE effect (order_id TEXT NOT NULL, event_id TEXT NOT NULL)`))
	require.NoError(t, processed.Migrate(ctx, db.Handle(), processed.Config{}))
	b := shop.NewChannelBroker(nil)
	defer b.Close()
	require.NoError(t, b.Declare(consumer))

	handled := make(chan string, 16)
	var cutOnce sync.Once
	var deliveries, redelivered atomic.Int64
	svc, err := shop.NewService(shop.ServiceConfig{
		Transport: b,
		Consumer:  consumer,
		DB:        sqlDB,
		Middleware: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				deliveries.Add(1)
				if marshaler.Redelivered(msg) {
					redelivered.Add(1)
				}
				out, err := h(msg)
				if err == nil {
					cutOnce.Do(func() { b.Cut(consumer) }) // committed; the ack is lost
				}
				return out, err
			}
		}},
		Handler: func(msg *message.Message) error {
			q, ok := shop.TxFromContext(msg.Context())
			if !ok {
				return middleware.Permanent(errors.New("no transaction"))
			}
			_, err := q.Exec(msg.Context(), `INSERT INTO effect (order_id, event_id) VALUES (?, ?)`, "o-1", msg.UUID)
			handled <- msg.UUID
			return err
		},
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	select {
	case <-svc.Running():
	case err := <-done:
		t.Fatal(err)
	}

	ev, err := marshaler.NewMessage(shop.EventOrderPlaced, map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	require.NoError(t, b.Publisher().Publish(shop.EventOrderPlaced, ev, ev.Copy()))
	waitQueued(t, b, consumer, 0)
	require.NoError(t, svc.Close())
	require.NoError(t, <-done)

	var n int
	require.NoError(t, sqlDB.QueryRow(`SELECT count(*) FROM effect`).Scan(&n))
	require.Equal(t, 1, n)
	require.Len(t, handled, 1)
	require.EqualValues(t, 3, deliveries.Load())
	require.EqualValues(t, 1, redelivered.Load())
}
