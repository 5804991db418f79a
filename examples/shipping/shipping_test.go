package shipping_test

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

type fixture struct {
	pool *pgxpool.Pool
	h    *shipping.Handler
	s    idempotencytest.Subject
	// claim is the claim layer alone (internal: the consumer's chain would
	// poison and ack), so the handler's results and error classes are seen.
	claim message.HandlerMiddleware
	rec   *recorder
}

type recorder struct {
	mu               sync.Mutex
	stale, processed int
}

func (r *recorder) RecordOutcome(o middleware.Observation) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch o.Outcome {
	case middleware.OutcomeStale:
		r.stale++
	case middleware.OutcomeProcessed:
		r.processed++
	}
}

// discard is a poison publisher that accepts and drops every message.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

func setup(t *testing.T) *fixture {
	t.Helper()
	pool, _ := testenv.Pool(t)
	require.NoError(t, shipping.Migrate(context.Background(), pool, processed.Config{}))
	h, err := shipping.NewHandler()
	require.NoError(t, err)
	rec := &recorder{}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Consumer: shipping.Consumer.Name,
		Recorder: rec,
	}, nil)
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: shipping.Consumer.Name,
		DB:       idempotency.Pgx(pool),
		Poison:   middleware.PoisonConfig{Publisher: discard{}, Topic: "shipping.events.dlq"},
		Recorder: rec,
	}, nil)
	require.NoError(t, err)
	return &fixture{pool: pool, h: h, rec: rec, claim: idem.Middleware, s: idempotencytest.Subject{
		Handler:  idempotencytest.NoPublish(h.Handle),
		Consumer: c,
		// The effect of one event: the copy of its order at its version.
		Effects: func(ctx context.Context, msg *message.Message) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM order_status_copy
				WHERE order_id = $1::jsonb->>'order_id' AND version = ($1::jsonb->>'version')::bigint`, string(msg.Payload)).Scan(&n)
			return n, err
		},
	}}
}

func status(t *testing.T, orderID string, version int64, st string) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessage(shop.EventOrderStatusChanged, shop.OrderStatusChanged{OrderID: orderID, Version: version, Status: st})
	require.NoError(t, err)
	return msg
}

func (f *fixture) copyOf(t *testing.T, orderID string) (int64, string) {
	t.Helper()
	var v int64
	var s string
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT version, status FROM order_status_copy WHERE order_id = $1`, orderID).Scan(&v, &s))
	return v, s
}

func TestCopyOnce(t *testing.T) {
	t.Parallel()
	f := setup(t)
	idempotencytest.DeliverTwice(t, f.s, status(t, "o-1", 2, "packed"))
	idempotencytest.DeliverConcurrently(t, f.s, status(t, "o-2", 2, "packed"), 6)
	v, s := f.copyOf(t, "o-1")
	require.Equal(t, int64(2), v)
	require.Equal(t, "packed", s)
}

// v3, v1, v2 (each its own event): the copy stays at v3; v1 and v2 are
// stale, marked as such, and not errors.
func TestOutOfOrder(t *testing.T) {
	t.Parallel()
	f := setup(t)
	h := f.claim(f.s.Handler)
	for _, m := range []*message.Message{status(t, "o-1", 3, "shipped"), status(t, "o-1", 1, "placed"), status(t, "o-1", 2, "packed")} {
		_, err := h(m)
		require.NoError(t, err)
	}
	v, s := f.copyOf(t, "o-1")
	require.Equal(t, int64(3), v)
	require.Equal(t, "shipped", s)
	applied, stale := f.h.Stats()
	require.EqualValues(t, 1, applied)
	require.EqualValues(t, 2, stale)
	require.Equal(t, 2, f.rec.stale)
	require.Equal(t, 1, f.rec.processed)
}

// A missing or null version is permanent and writes nothing.
func TestMissingVersionIsPermanent(t *testing.T) {
	t.Parallel()
	f := setup(t)
	h := f.claim(f.s.Handler)
	for _, p := range []string{`{"order_id":"o-3","status":"x"}`, `{"order_id":"o-3","version":null,"status":"x"}`, `{"order_id":"o-3"}`, `[]`} {
		msg, err := marshaler.NewMessage(shop.EventOrderStatusChanged, []byte(p))
		require.NoError(t, err)
		_, err = h(msg)
		require.True(t, middleware.IsPermanent(err), "%s: %v", p, err)
	}
	_, err := h(func() *message.Message {
		m, _ := marshaler.NewMessage(shop.EventOrderStatusChanged, []byte(`{"order_id":"o-3","status":"x"}`))
		return m
	}())
	require.ErrorIs(t, err, versioned.ErrVersionMissing)
	var n int
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM order_status_copy`).Scan(&n))
	require.Zero(t, n)
}

// On SQLite (the embedded demo): v3, v1, v2 leave the copy at v3, the older
// two stale; a redelivery applies nothing.
func TestOutOfOrderSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.SQLiteDB(t)
	require.NoError(t, shipping.MigrateDB(ctx, shop.SQLiteDB(db), processed.Config{}))
	h, err := shipping.NewHandlerFor(idempotency.SQLite)
	require.NoError(t, err)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: idempotency.SQLite})
	require.NoError(t, err)
	rec := &recorder{}
	// The claim layer alone (internal), so the handler's results are seen.
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewStdBeginner(db)), Store: store, Consumer: shipping.Consumer.Name, Recorder: rec,
	}, nil)
	require.NoError(t, err)
	handle := idem.Middleware(idempotencytest.NoPublish(h.Handle))
	v3 := status(t, "o-1", 3, "shipped")
	for _, m := range []*message.Message{v3, status(t, "o-1", 1, "placed"), status(t, "o-1", 2, "packed"), v3.Copy()} {
		_, err := handle(m)
		require.NoError(t, err)
	}
	var v int64
	var st string
	require.NoError(t, db.QueryRow(`SELECT version, status FROM order_status_copy WHERE order_id = ?`, "o-1").Scan(&v, &st))
	require.Equal(t, int64(3), v)
	require.Equal(t, "shipped", st)
	require.Equal(t, 2, rec.stale)
	require.Equal(t, 1, rec.processed)
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}

// The shipping handler keeps its copy right whatever fails where: each
// statement, the commit, the ack (idempotencytest.Explore).
func TestCopyUnderFaults(t *testing.T) {
	t.Parallel()
	f := setup(t)
	r := idempotencytest.Explore(t, f.s, status(t, "o-explore", 3, "shipped"))
	require.NotEmpty(t, r.Statements)
	require.Empty(t, r.Divergences)
}
