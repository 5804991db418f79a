package order_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

func newService(t *testing.T) (*order.Service, *pgxpool.Pool) {
	t.Helper()
	pool, _ := testenv.Pool(t)
	svc, err := order.New(order.Config{Pool: pool})
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(context.Background()))
	require.NoError(t, svc.Migrate(context.Background()), "idempotent")
	return svc, pool
}

// outboxRow is one row of the order outbox.
type outboxRow struct {
	Topic, EventID string
	Payload        []byte
	Metadata       map[string]string
}

// outboxRows returns the rows in the outbox, in order.
func outboxRows(t *testing.T, pool *pgxpool.Pool) []outboxRow {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT topic, event_id, payload, metadata FROM order_outbox ORDER BY id`)
	require.NoError(t, err)
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		var md string
		require.NoError(t, rows.Scan(&r.Topic, &r.EventID, &r.Payload, &md))
		require.NoError(t, json.Unmarshal([]byte(md), &r.Metadata))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

// The order row and its outbox row commit together; the outbox row is the
// message whose UUID is a UUIDv7 event id set now.
func TestPlaceOrderWritesOutbox(t *testing.T) {
	t.Parallel()
	svc, pool := newService(t)
	ctx := context.Background()
	id, err := svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "a", Quantity: "2.000"}, {SKU: "b", Quantity: "0.250"}})
	require.NoError(t, err)
	u := uuid.MustParse(id)
	require.Equal(t, uuid.Version(7), u.Version())

	rows := outboxRows(t, pool)
	require.Len(t, rows, 1)
	env := rows[0]
	require.Equal(t, shop.EventOrderPlaced, env.Topic)
	require.Equal(t, id, env.EventID)
	require.Equal(t, shop.EventOrderPlaced, env.Metadata[marshaler.MetadataEventName])
	require.NotEmpty(t, env.Metadata[marshaler.MetadataOccurredAt])
	require.JSONEq(t, `{"order_id":"o-1","version":1,"status":"placed","lines":[
		{"line_no":1,"sku":"a","quantity":"2.000"},{"line_no":2,"sku":"b","quantity":"0.250"}]}`, string(env.Payload))

	var q string
	require.NoError(t, pool.QueryRow(ctx, `SELECT quantity::text FROM order_line WHERE order_id = 'o-1' AND line_no = 1`).Scan(&q))
	require.Equal(t, "2.000", q)

	// A refused order writes nothing, outbox included.
	_, err = svc.PlaceOrder(ctx, "o-2", []shop.OrderLine{{SKU: "a", Quantity: "1e3"}})
	require.ErrorIs(t, err, shop.ErrBadQuantity)
	_, err = svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "a", Quantity: "1"}})
	require.Error(t, err, "duplicate order id")
	require.Len(t, outboxRows(t, pool), 1)
}

func TestChangeStatusVersionsAndRollback(t *testing.T) {
	t.Parallel()
	svc, pool := newService(t)
	ctx := context.Background()
	_, err := svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "a", Quantity: "1"}})
	require.NoError(t, err)
	v, _, err := svc.ChangeStatus(ctx, "o-1", "packed")
	require.NoError(t, err)
	require.EqualValues(t, 2, v)
	v, _, err = svc.ChangeStatus(ctx, "o-1", "shipped")
	require.NoError(t, err)
	require.EqualValues(t, 3, v)
	_, _, err = svc.ChangeStatus(ctx, "nope", "shipped")
	require.ErrorIs(t, err, pgx.ErrNoRows)
	require.Len(t, outboxRows(t, pool), 3)

	// PublishInTx in a transaction that rolls back leaves nothing.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	msg, err := marshaler.NewMessage(shop.EventOrderStatusChanged, shop.OrderStatusChanged{OrderID: "o-1", Version: 9, Status: "x"})
	require.NoError(t, err)
	require.NoError(t, svc.PublishInTx(ctx, tx, shop.EventOrderStatusChanged, msg))
	require.NoError(t, tx.Rollback(ctx))
	require.Len(t, outboxRows(t, pool), 3)
}

// tap is a queue bound to both order events on a test topology.
type tap struct {
	topo  shop.Topology
	queue string
	ch    *amqp091.Channel
}

func newTap(t *testing.T) *tap {
	t.Helper()
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	c := shop.Consumer{Name: "tap", Bindings: []string{shop.EventOrderPlaced, shop.EventOrderStatusChanged}}
	topo := shop.Topology{Prefix: testenv.UniqueName("order") + "."}
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, topo.Declare(ch, c))
	t.Cleanup(func() { _ = topo.Delete(ch, c); _ = conn.Close() })
	return &tap{topo: topo, queue: topo.Queue(c), ch: ch}
}

// next waits for the next delivery on the tap.
func (tp *tap) next(t *testing.T) amqp091.Delivery {
	t.Helper()
	var d amqp091.Delivery
	require.Eventually(t, func() bool {
		var ok bool
		var err error
		d, ok, err = tp.ch.Get(tp.queue, true)
		require.NoError(t, err)
		return ok
	}, 15*time.Second, 10*time.Millisecond)
	return d
}

func (tp *tap) publisher(t *testing.T) *wamqp.Publisher {
	t.Helper()
	pub, err := wamqp.NewPublisher(tp.topo.PublisherConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// The relay publishes each outbox message to the exchange with its event
// name as routing key and the event id set when the row was written; Pending
// drops to 0; Replay republishes a time range with the original ids.
func TestRelayAndReplay(t *testing.T) {
	t.Parallel()
	svc, pool := newService(t)
	tp := newTap(t)
	ctx := context.Background()
	t0 := time.Now()
	id1, err := svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "a", Quantity: "2.000"}})
	require.NoError(t, err)
	t1 := time.Now()
	_, id2, err := svc.ChangeStatus(ctx, "o-1", "packed")
	require.NoError(t, err)
	n, err := svc.Pending(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)

	relay, err := order.NewRelay(order.RelayConfig{Pool: pool, Publisher: tp.publisher(t), PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() { _ = relay.Close(); <-done })

	for i, want := range []struct{ id, name string }{{id1, shop.EventOrderPlaced}, {id2, shop.EventOrderStatusChanged}} {
		d := tp.next(t)
		require.Equal(t, want.name, d.RoutingKey, "delivery %d", i)
		require.Equal(t, want.id, d.MessageId)
		env, err := marshaler.Decode(d.Body, 0)
		require.NoError(t, err)
		require.Equal(t, want.id, env.EventID.String(), "the event id set when the outbox row was written")
		require.Equal(t, want.name, env.EventName)
	}
	require.Eventually(t, func() bool { n, err := svc.Pending(ctx); return err == nil && n == 0 }, 10*time.Second, 10*time.Millisecond)

	// Replay [t0, t1): the placed event only, same id.
	n, err = svc.Replay(ctx, tp.publisher(t), t0, t1)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	d := tp.next(t)
	env, err := marshaler.Decode(d.Body, 0)
	require.NoError(t, err)
	require.Equal(t, id1, env.EventID.String())
	require.JSONEq(t, `{"order_id":"o-1","version":1,"status":"placed","lines":[{"line_no":1,"sku":"a","quantity":"2.000"}]}`, string(env.Payload))

	_, err = svc.Replay(ctx, tp.publisher(t), t1, t0)
	require.Error(t, err, "empty range")
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	_, err := order.New(order.Config{})
	require.ErrorContains(t, err, "Config.Pool")
	pool, _ := testenv.Pool(t)
	_, err = order.New(order.Config{Pool: pool, OutboxTopic: "bad-topic"})
	require.ErrorContains(t, err, "OutboxTopic")
	_, err = order.NewRelay(order.RelayConfig{Pool: pool})
	require.ErrorContains(t, err, "Publisher")
	// MaxBackoff reaches the library relay, which validates it.
	_, err = order.NewRelay(order.RelayConfig{Pool: pool, Publisher: discardPublisher{}, MaxBackoff: -time.Second})
	require.ErrorContains(t, err, "RelayConfig.MaxBackoff")
}

// discardPublisher publishes nothing.
type discardPublisher struct{}

func (discardPublisher) Publish(string, ...*message.Message) error { return nil }
func (discardPublisher) Close() error                              { return nil }

// On SQLite (the embedded demo) with the shop's channel broker: the same
// relay and replay contract, and ChangeStatus versions.
func TestRelayAndReplaySQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.SQLiteDB(t)
	svc, err := order.New(order.Config{DB: db})
	require.NoError(t, err)
	require.NoError(t, svc.Migrate(ctx))
	require.NoError(t, svc.Migrate(ctx), "idempotent")

	t0 := time.Now()
	id1, err := svc.PlaceOrder(ctx, "o-1", []shop.OrderLine{{SKU: "a", Quantity: "2.000"}})
	require.NoError(t, err)
	t1 := time.Now()
	v, id2, err := svc.ChangeStatus(ctx, "o-1", "packed")
	require.NoError(t, err)
	require.EqualValues(t, 2, v)
	_, _, err = svc.ChangeStatus(ctx, "o-404", "packed")
	require.Error(t, err, "unknown order")
	n, err := svc.Pending(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)

	c := shop.Consumer{Name: "tap", Bindings: []string{shop.EventOrderPlaced, shop.EventOrderStatusChanged}}
	b := shop.NewChannelBroker(nil)
	t.Cleanup(func() { _ = b.Close() })
	require.NoError(t, b.Declare(c))
	sub, err := b.Subscriber(c, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "")
	require.NoError(t, err)
	next := func() *message.Message {
		t.Helper()
		select {
		case m := <-msgs:
			m.Ack()
			return m
		case <-time.After(10 * time.Second):
			t.Fatal("nothing relayed")
			return nil
		}
	}

	relay, err := order.NewRelay(order.RelayConfig{DB: db, Publisher: b.Publisher(), PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() { _ = relay.Close(); <-done })
	for _, want := range []struct{ id, name string }{{id1, shop.EventOrderPlaced}, {id2, shop.EventOrderStatusChanged}} {
		m := next()
		require.Equal(t, want.id, m.UUID)
		require.Equal(t, want.name, m.Metadata.Get(marshaler.MetadataEventName))
	}
	require.Eventually(t, func() bool { n, err := svc.Pending(ctx); return err == nil && n == 0 }, 10*time.Second, 10*time.Millisecond)

	n, err = svc.Replay(ctx, b.Publisher(), t0, t1)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	m := next()
	require.Equal(t, id1, m.UUID)
	require.JSONEq(t, `{"order_id":"o-1","version":1,"status":"placed","lines":[{"line_no":1,"sku":"a","quantity":"2.000"}]}`, string(m.Payload))
}
