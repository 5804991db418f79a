package outbox_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := outbox.New(outbox.Config{ForwarderTopic: "bad topic; drop"}, nil)
	require.ErrorContains(t, err, "Config.ForwarderTopic")
	o, err := outbox.New(outbox.Config{}, nil)
	require.NoError(t, err)
	require.Equal(t, outbox.DefaultForwarderTopic, o.ForwarderTopic())
	_, err = o.NewRelay(nil, nil, outbox.RelayConfig{})
	require.Error(t, err)
}

// A message written in a transaction exists only if the transaction
// commits, and the relay publishes it with the UUID it was written with.
func TestWriteInTxThenRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	o, err := outbox.New(outbox.Config{ForwarderTopic: "orders_outbox"}, nil)
	require.NoError(t, err)
	require.NoError(t, o.InitializeSchema(ctx, wsql.BeginnerFromPgx(pool)))

	write := func(commit bool) *message.Message {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		pub, err := o.PgxPublisher(tx)
		require.NoError(t, err)
		m, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-1"})
		require.NoError(t, err)
		require.NoError(t, pub.Publish("events", m))
		if commit {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
		return m
	}
	write(false)
	kept := write(true)

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	relay, err := o.NewRelay(wsql.BeginnerFromPgx(pool), broker, outbox.RelayConfig{
		Subscriber: wsql.SubscriberConfig{PollInterval: 20 * time.Millisecond},
	})
	require.NoError(t, err)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = relay.Run(runCtx) }()
	defer relay.Close()
	msgs, err := broker.Subscribe(runCtx, "events")
	require.NoError(t, err)
	select {
	case got := <-msgs:
		got.Ack()
		require.Equal(t, kept.UUID, got.UUID)
		require.Equal(t, string(kept.Payload), string(got.Payload))
	case <-time.After(30 * time.Second):
		t.Fatal("the committed message was never relayed")
	}
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM watermill_orders_outbox`).Scan(&rows))
	require.Equal(t, 1, rows, "the rolled back write left no row")
}
