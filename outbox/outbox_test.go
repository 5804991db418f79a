package outbox_test

import (
	"context"
	"io/fs"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	_, err := outbox.New(outbox.Config{Table: "bad table; drop", DB: db}, nil)
	require.ErrorContains(t, err, "Config.Table")
	_, err = outbox.New(outbox.Config{}, nil)
	require.ErrorContains(t, err, "Config.DB")
	_, err = outbox.New(outbox.Config{DB: idempotency.SQL(nil, idempotency.MySQL)}, nil)
	require.ErrorContains(t, err, "Config.DB")
	o, err := outbox.New(outbox.Config{DB: db}, nil)
	require.NoError(t, err)
	require.Equal(t, outbox.DefaultTable, o.Table())
	_, err = o.NewRelay(nil, outbox.RelayConfig{})
	require.Error(t, err)
	require.ErrorContains(t, outbox.RelayConfig{BatchSize: -1}.Validate(), "RelayConfig.BatchSize")
	require.ErrorContains(t, outbox.RelayConfig{PollInterval: -1}.Validate(), "RelayConfig.PollInterval")
	require.ErrorContains(t, outbox.ReplayFilter{}.Validate(), "ReplayFilter.From/To")
	fsys, err := o.MigrationsFS()
	require.NoError(t, err)
	ms, err := fs.Glob(fsys, "*.up.sql")
	require.NoError(t, err)
	require.NotEmpty(t, ms)
}

// traceparent stands in for an OpenTelemetry publisher decorator (the
// router's AddPublisherDecorators): it injects the W3C traceparent of the
// message's context into its metadata at publish time.
type traceKey struct{}

func traceparentDecorator(pub message.Publisher) (message.Publisher, error) {
	return message.MessageTransformPublisherDecorator(func(m *message.Message) {
		if tp, ok := m.Context().Value(traceKey{}).(string); ok {
			m.Metadata.Set("traceparent", tp)
		}
	})(pub)
}

// Item 7: a message written to the outbox inside a traced handler carries
// the traceparent the publisher decorators injected from its context; the
// relay keeps it, and the consumer reads it.
func TestTraceparentReachesConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	o, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "traced_outbox", PublisherDecorators: []message.PublisherDecorator{traceparentDecorator}}, nil)
	require.NoError(t, err)
	require.NoError(t, o.Migrate(ctx))

	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	pub, err := o.PgxPublisher(tx)
	require.NoError(t, err)
	m, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	m.SetContext(context.WithValue(ctx, traceKey{}, tp))
	require.NoError(t, pub.Publish("events", m))
	require.NoError(t, tx.Commit(ctx))

	got := relayedOnGoChannel(t, o, "events")
	require.Equal(t, m.UUID, got.UUID)
	require.Equal(t, tp, got.Metadata.Get("traceparent"))
	require.Equal(t, "order.placed", marshaler.EventName(got))
}

// relayedOnGoChannel runs o's relay to a GoChannel and returns the first
// message it publishes on topic (acked).
func relayedOnGoChannel(t *testing.T, o *outbox.Outbox, topic string) *message.Message {
	t.Helper()
	ctx := context.Background()
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	defer broker.Close()
	relay, err := o.NewRelay(broker, outbox.RelayConfig{PollInterval: 5 * time.Millisecond})
	require.NoError(t, err)
	go func() { _ = relay.Run(ctx) }()
	defer relay.Close()
	msgs, err := broker.Subscribe(ctx, topic)
	require.NoError(t, err)
	select {
	case got := <-msgs:
		got.Ack()
		return got
	case <-time.After(30 * time.Second):
		t.Fatal("never relayed")
		return nil
	}
}

// A message a handler forwards (a copy of the one it received) is written
// to the outbox without the keys of that delivery: the relay publishing it
// on GoChannel (or the watermill-sql publisher, neither with an adapter to
// drop them) would otherwise hand the next consumer a first delivery that
// says it was redelivered. The caller's message is left as it was.
func TestForwardedMessageIsRelayedWithoutTheKeysOfItsDelivery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	o, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "forwarded_outbox"}, nil)
	require.NoError(t, err)
	require.NoError(t, o.Migrate(ctx))

	received, err := marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-1"})
	require.NoError(t, err)
	delivery := testenv.DeliveryMetadata()
	for k, v := range delivery {
		received.Metadata.Set(k, v)
	}
	received.Metadata.Set("correlation_id", "c-1")
	forwarded := received.Copy()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	pub, err := o.PgxPublisher(tx)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("events", forwarded))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, "3", forwarded.Metadata.Get(marshaler.MetadataDeliveryCount), "the caller's message is left as it was")

	got := relayedOnGoChannel(t, o, "events")
	require.Equal(t, received.UUID, got.UUID)
	for k := range delivery {
		require.NotContains(t, got.Metadata, k)
	}
	require.Equal(t, "c-1", got.Metadata.Get("correlation_id"), "the message's own keys are kept")
}
