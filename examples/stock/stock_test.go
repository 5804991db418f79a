package stock_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// newConsumer is the stock consumer on db, as shop.NewService builds it,
// with a poison publisher that accepts everything.
func newConsumer(t *testing.T, db idempotency.DB) *middleware.Consumer {
	t.Helper()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: stock.Consumer.Name,
		DB:       db,
		Poison:   middleware.PoisonConfig{Publisher: discard{}, Topic: "stock.events.dlq"},
	}, nil)
	require.NoError(t, err)
	return c
}

// discard is a poison publisher that accepts and drops every message.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

func setup(t *testing.T) (*pgxpool.Pool, idempotencytest.Subject) {
	t.Helper()
	pool, _ := testenv.Pool(t)
	require.NoError(t, stock.Migrate(context.Background(), pool, processed.Config{}))
	return pool, idempotencytest.Subject{
		Handler:  idempotencytest.NoPublish(stock.Handle),
		Consumer: newConsumer(t, idempotency.Pgx(pool)),
		Effects: func(ctx context.Context, msg *message.Message) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM reservation WHERE event_id = $1`, msg.UUID).Scan(&n)
			return n, err
		},
		WantEffects: 2, // one reservation per line
	}
}

func placed(t *testing.T, orderID string) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessage(shop.EventOrderPlaced, shop.OrderPlaced{OrderID: orderID, Version: 1, Status: "placed",
		Lines: []shop.OrderLine{{LineNo: 1, SKU: "sku-b", Quantity: "2.000"}, {LineNo: 2, SKU: "sku-a", Quantity: "0.250"}}})
	require.NoError(t, err)
	return msg
}

// A redelivered order reserves its lines once, quantities exact.
func TestReserveOnce(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	idempotencytest.DeliverTwice(t, s, placed(t, "o-1"))
	var q, total string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT
		(SELECT quantity::text FROM reservation WHERE order_id = 'o-1' AND line_no = 1),
		(SELECT sum(reserved)::text FROM stock_level)`).Scan(&q, &total))
	require.Equal(t, "2.000", q)
	require.Equal(t, "2.250", total)
}

// Eight copies of one order at the same moment: one reservation per line.
func TestReserveOnceConcurrently(t *testing.T) {
	t.Parallel()
	_, s := setup(t)
	idempotencytest.DeliverConcurrently(t, s, placed(t, "o-1"), 8)
}

// A payload that is not an order is permanent (dead-letter queue, no
// retry), and nothing is written, claim included.
func TestBadPayloadIsPermanent(t *testing.T) {
	t.Parallel()
	pool, s := setup(t)
	// The claim layer alone (internal: the consumer's chain would poison
	// and ack), so the handler's error class is seen.
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Consumer: stock.Consumer.Name,
	}, nil)
	require.NoError(t, err)
	h := idem.Middleware(s.Handler)
	for _, p := range []string{
		`not json`,
		`{"order_id":"","lines":[{"line_no":1,"sku":"a","quantity":"1"}]}`,
		`{"order_id":"o-1","lines":[]}`,
		`{"order_id":"o-1","lines":[{"line_no":1,"sku":"a","quantity":"1e3"}]}`,
		`{"order_id":"o-1","lines":[{"line_no":1,"sku":"a","quantity":2}]}`,
		`{"order_id":"o-1","lines":[{"line_no":0,"sku":"a","quantity":"2"}]}`,
	} {
		msg, err := marshaler.NewMessage(shop.EventOrderPlaced, []byte(p))
		if err != nil { // not JSON: build the message by hand
			msg = message.NewMessage(placed(t, "x").UUID, []byte(p))
		}
		_, err = h(msg)
		require.Error(t, err, p)
		require.True(t, middleware.IsPermanent(err), "%s: %v", p, err)
	}
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM reservation) + (SELECT count(*) FROM processed_event)`).Scan(&n))
	require.Zero(t, n)
}

// The same bad payloads through the service's whole consumer (public API:
// shop.NewService on middleware.NewConsumer, the in-process broker): each
// reaches the dead-letter list once, classed permanent, after one handler
// call (never retried); nothing is written, claim included.
func TestBadPayloadDeadLetteredOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	require.NoError(t, stock.Migrate(ctx, pool, processed.Config{}))
	broker := shop.NewChannelBroker(nil)
	t.Cleanup(func() { _ = broker.Close() })
	require.NoError(t, broker.Declare(stock.Consumer))
	var calls atomic.Int64
	svc, err := shop.NewService(shop.ServiceConfig{
		Transport: broker,
		Consumer:  stock.Consumer,
		Pool:      pool,
		Handler: func(msg *message.Message) error {
			calls.Add(1)
			return stock.Handle(msg)
		},
	})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() { _ = svc.Close(); <-done })
	<-svc.Running()

	payloads := []string{
		`{"order_id":"","lines":[{"line_no":1,"sku":"a","quantity":"1"}]}`,
		`{"order_id":"o-1","lines":[]}`,
		`{"order_id":"o-1","lines":[{"line_no":1,"sku":"a","quantity":"1e3"}]}`,
		`{"order_id":"o-1","lines":[{"line_no":1,"sku":"a","quantity":2}]}`,
		`{"order_id":"o-1","lines":[{"line_no":0,"sku":"a","quantity":"2"}]}`,
	}
	for _, p := range payloads {
		msg, err := marshaler.NewMessage(shop.EventOrderPlaced, []byte(p))
		require.NoError(t, err)
		require.NoError(t, broker.Publisher().Publish(shop.EventOrderPlaced, msg))
	}
	var dead []shop.DeadLetter
	require.Eventually(t, func() bool {
		d, err := broker.DrainDeadLetters(stock.Consumer)
		if err != nil {
			return false
		}
		dead = append(dead, d...)
		return len(dead) >= len(payloads)
	}, 10*time.Second, 10*time.Millisecond)
	require.Len(t, dead, len(payloads))
	for _, d := range dead {
		require.Equal(t, "permanent", d.Headers[middleware.MetadataPoisonClass], "%v", d.Headers)
	}
	require.EqualValues(t, len(payloads), calls.Load(), "one call each: a permanent error is not retried")
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM reservation) + (SELECT count(*) FROM processed_event)`).Scan(&n))
	require.Zero(t, n)
}

func TestHandleOutsideMiddleware(t *testing.T) {
	t.Parallel()
	err := stock.Handle(placed(t, "o-1"))
	require.ErrorIs(t, err, stock.ErrNoTransaction)
	require.True(t, middleware.IsPermanent(err))
}

func setupSQLite(t *testing.T) (*sql.DB, idempotencytest.Subject) {
	t.Helper()
	db := testenv.SQLiteDB(t)
	require.NoError(t, stock.MigrateDB(context.Background(), shop.SQLiteDB(db), processed.Config{}))
	return db, idempotencytest.Subject{
		Handler:  idempotencytest.NoPublish(stock.HandlerFor(idempotency.SQLite)),
		Consumer: newConsumer(t, idempotency.SQL(db, idempotency.SQLite)),
		Effects: func(ctx context.Context, msg *message.Message) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservation WHERE event_id = ?`, msg.UUID).Scan(&n)
			return n, err
		},
		WantEffects: 2,
	}
}

// On SQLite (the embedded demo): a redelivered order reserves its lines
// once, and so do eight concurrent copies.
func TestReserveOnceSQLite(t *testing.T) {
	t.Parallel()
	db, s := setupSQLite(t)
	idempotencytest.DeliverTwice(t, s, placed(t, "o-1"))
	idempotencytest.DeliverConcurrently(t, s, placed(t, "o-2"), 8)
	var total float64
	require.NoError(t, db.QueryRow(`SELECT sum(reserved) FROM stock_level`).Scan(&total))
	require.InDelta(t, 4.5, total, 1e-9)
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}

// The stock handler applies its effects once whatever fails where: each
// statement, the commit, the ack (idempotencytest.Explore).
func TestReserveOnceUnderFaults(t *testing.T) {
	t.Parallel()
	_, s := setup(t)
	r := idempotencytest.Explore(t, s, placed(t, "o-explore"))
	require.NotEmpty(t, r.Statements)
	require.Empty(t, r.Divergences)
}
