package billing_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/billing"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/processed"
)

// env is one billing service wired as the demo wires it, without a broker:
// each handler composed with the recommended chain and RouteUncertain right
// after the poison middleware, called directly as a router would.
type env struct {
	db      shop.DB
	svc     *billing.Service
	charge  message.HandlerFunc // order events → confirmations
	confirm message.HandlerFunc // confirmations → e-mail

	mu     sync.Mutex
	topics map[string][]*message.Message // poison and reconciliation topics
}

func newEnv(t *testing.T, inner func(message.HandlerFunc) message.HandlerFunc) *env {
	return newEnvOn(t, idempotency.PostgreSQL, inner)
}

// newEnvOn is newEnv on PostgreSQL or on SQLite; on SQLite the runner's
// records are in a file of their own (see billing.MigrateDB).
func newEnvOn(t *testing.T, dialect idempotency.Dialect, inner func(message.HandlerFunc) message.HandlerFunc) *env {
	t.Helper()
	ctx := context.Background()
	var db shop.DB
	var runner *operation.Runner
	var beginner inbox.TxBeginner
	var store *processedstore.Store
	if dialect == idempotency.SQLite {
		db = shop.SQLiteDB(testenv.SQLiteDB(t))
		ops := testenv.SQLiteDB(t)
		var err error
		runner, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(ops, idempotency.SQLite)}, nil)
		require.NoError(t, err)
		require.NoError(t, runner.Migrate(ctx))
		require.NoError(t, billing.MigrateDB(ctx, db, processed.Config{}, nil))
		beginner = mustBeginner(inbox.NewStdBeginner(db.SQL))
		store, err = processedstore.NewStore(processedstore.Config{Dialect: idempotency.SQLite})
		require.NoError(t, err)
	} else {
		pool, schema := testenv.Pool(t)
		db = shop.PgxDB(pool)
		var err error
		runner, err = operation.NewRunner(operation.Config{DB: idempotency.Pgx(testenv.PoolOn(t, schema, 4))}, nil)
		require.NoError(t, err)
		require.NoError(t, billing.Migrate(ctx, pool, processed.Config{}, runner))
		beginner = mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{}))
	}
	svc, err := billing.New(billing.Config{Runner: runner, Provider: billing.NewProvider(), Mailer: billing.NewMailer(), Dialect: dialect})
	require.NoError(t, err)

	e := &env{db: db, svc: svc, topics: map[string][]*message.Message{}}
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	for _, topic := range []string{"billing.dlq", "billing.reconcile", "billing-mailer.dlq"} {
		ch, err := pubsub.Subscribe(ctx, topic)
		require.NoError(t, err)
		go func() {
			for m := range ch {
				e.mu.Lock()
				e.topics[topic] = append(e.topics[topic], m)
				e.mu.Unlock()
				m.Ack()
			}
		}()
	}
	wrap := func(consumer string, h message.HandlerFunc) message.HandlerFunc {
		idem, err := inbox.NewIdempotent(inbox.Config{
			Beginner: beginner,
			Store:    store,
			Consumer: consumer,
		}, nil)
		require.NoError(t, err)
		route, err := operation.RouteUncertain(pubsub, consumer+".reconcile", nil)
		require.NoError(t, err)
		all, err := inbox.NewChain(inbox.ChainConfig{
			Idempotent: idem, PoisonPublisher: pubsub, PoisonTopic: consumer + ".dlq",
			AfterPoison: []message.HandlerMiddleware{route},
			MaxRetries:  3, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond,
		}, nil)
		require.NoError(t, err)
		for i := len(all) - 1; i >= 0; i-- {
			h = all[i](h)
		}
		return h
	}
	h := message.HandlerFunc(svc.HandleOrderPlaced)
	if inner != nil {
		h = inner(h)
	}
	e.charge = wrap(billing.Consumer.Name, h)
	e.confirm = wrap(billing.MailerConsumer.Name, func(msg *message.Message) ([]*message.Message, error) {
		return nil, svc.HandleConfirmation(msg)
	})
	return e
}

func (e *env) topic(name string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.topics[name])
}

func (e *env) payments(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, e.db.Querier().QueryRow(context.Background(), `SELECT count(*) FROM billing_payment`).Scan(&n))
	return n
}

func placed(t *testing.T, orderID string, quantities ...string) *message.Message {
	t.Helper()
	ev := shop.OrderPlaced{OrderID: orderID, Version: 1, Status: "placed"}
	for i, q := range quantities {
		ev.Lines = append(ev.Lines, shop.OrderLine{LineNo: i + 1, SKU: "sku", Quantity: q})
	}
	msg, err := marshaler.NewMessage(shop.EventOrderPlaced, ev)
	require.NoError(t, err)
	return msg
}

// Five orders, each delivered twice, one of them also republished under a
// new event id, with every second charge timing out after it was made: five
// charges, five ledger rows, five e-mails; the timeouts were settled by a
// lookup, never by a second charge request.
func TestChargeOnceConfirmOnce(t *testing.T) {
	t.Parallel()
	chargeOnceConfirmOnce(t, newEnv(t, nil))
}

// The same on SQLite (the embedded demo).
func TestChargeOnceConfirmOnceSQLite(t *testing.T) {
	t.Parallel()
	chargeOnceConfirmOnce(t, newEnvOn(t, idempotency.SQLite, nil))
}

func chargeOnceConfirmOnce(t *testing.T, e *env) {
	t.Helper()
	e.svc.Provider().InjectTimeouts(2)

	var msgs []*message.Message
	for _, id := range []string{"o-1", "o-2", "o-3", "o-4", "o-5"} {
		m := placed(t, id, "2.000", "0.250")
		msgs = append(msgs, m, m.Copy())
	}
	msgs = append(msgs, placed(t, "o-3", "2.000", "0.250")) // same order, another event id
	var confirmations []*message.Message
	for _, m := range msgs {
		out, err := e.charge(m)
		require.NoError(t, err)
		confirmations = append(confirmations, out...)
	}
	// The first delivery of each order and the republished o-3 produce one;
	// duplicates of an event id are skipped by the claim and produce none.
	require.Len(t, confirmations, 6)
	for _, c := range confirmations {
		for range 2 { // each confirmation delivered twice
			_, err := e.confirm(c.Copy())
			require.NoError(t, err)
		}
	}

	p := e.svc.Provider()
	require.Equal(t, 5, e.svc.ExpectedCharges())
	require.Equal(t, 5, p.Charges())
	require.Equal(t, 5, p.Calls(), "the republished o-3 got the recorded charge without a call")
	require.Equal(t, 2, p.Lookups(), "o-2 and o-4 timed out and were looked up")
	require.Equal(t, 5, e.payments(t))
	require.Equal(t, 5, e.svc.Mailer().Count())
	require.Equal(t, "Payment received for order o-1", e.svc.Mailer().Sent()[0].Subject)
	require.Contains(t, e.svc.Mailer().Sent()[0].Body, "22.50 EUR")
	require.Zero(t, e.topic("billing.dlq"))
	require.Zero(t, e.topic("billing.reconcile"))
	require.Zero(t, e.topic("billing-mailer.dlq"))
}

// An attempt that charged and then failed (after the handler, inside the
// transaction) rolls back its ledger row and its confirmation with it; the
// retry gets the recorded charge and produces the only confirmation.
func TestNoConfirmationFromAFailedAttempt(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	failed := false
	e := newEnv(t, func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			mu.Lock()
			defer mu.Unlock()
			if err == nil && !failed {
				failed = true
				return out, errors.New("disk full") // the transaction rolls back
			}
			return out, err
		}
	})
	out, err := e.charge(placed(t, "o-1", "1"))
	require.NoError(t, err, "retried in process")
	require.Len(t, out, 1)
	require.True(t, failed)
	require.Equal(t, 1, e.svc.Provider().Calls())
	require.Equal(t, 1, e.payments(t))

	key, err := billing.ChargeKey("o-1")
	require.NoError(t, err)
	require.Equal(t, billing.ConfirmationEventID(key).String(), out[0].UUID)
	require.Equal(t, uuid.Version(5), uuid.MustParse(out[0].UUID).Version())
	_, err = e.confirm(out[0])
	require.NoError(t, err)
	require.Equal(t, 1, e.svc.Mailer().Count())
}

// Another event that reuses an order's charge for another amount is a
// conflict: dead-letter queue, no provider call, no ledger change.
func TestOtherAmountForAnOrderIsPermanent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	_, err := e.charge(placed(t, "o-1", "1"))
	require.NoError(t, err)
	out, err := e.charge(placed(t, "o-1", "2"))
	require.NoError(t, err, "poisoned and acked")
	require.Empty(t, out)
	require.Equal(t, 1, e.topic("billing.dlq"))
	require.Equal(t, 1, e.svc.Provider().Calls())
	require.Equal(t, 1, e.payments(t))

	// A payload that is no order: permanent too, nothing called.
	bad := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{"order_id":"o-2","lines":[{"line_no":1,"sku":"s","quantity":"-1"}]}`))
	_, err = e.charge(bad)
	require.NoError(t, err)
	require.Equal(t, 2, e.topic("billing.dlq"))
	require.Equal(t, 1, e.svc.Provider().Calls())
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	runner, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(pool)}, nil)
	require.NoError(t, err)
	for _, cfg := range []billing.Config{
		{Provider: billing.NewProvider(), Mailer: billing.NewMailer()},
		{Runner: runner, Mailer: billing.NewMailer()},
		{Runner: runner, Provider: billing.NewProvider()},
		{Runner: runner, Provider: billing.NewProvider(), Mailer: billing.NewMailer(), UnitPriceMinor: -1},
	} {
		_, err := billing.New(cfg)
		require.Error(t, err)
	}
	// Outside a consumer's attempt the handler refuses to run.
	svc, err := billing.New(billing.Config{Runner: runner, Provider: billing.NewProvider(), Mailer: billing.NewMailer()})
	require.NoError(t, err)
	_, err = svc.HandleOrderPlaced(placed(t, "o-1", "1"))
	require.ErrorIs(t, err, billing.ErrNoTransaction)
	require.True(t, middleware.IsPermanent(err))
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}

// The billing handler charges once whatever fails where: each statement,
// the commit, the ack (idempotencytest.Explore). Every copy Explore
// delivers is the same order, so one charge in all: a second is the
// provider called again.
func TestChargeOnceUnderFaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	runner, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(testenv.PoolOn(t, schema, 4))}, nil)
	require.NoError(t, err)
	require.NoError(t, billing.Migrate(ctx, pool, processed.Config{}, runner))
	provider := billing.NewProvider()
	svc, err := billing.New(billing.Config{Runner: runner, Provider: provider, Mailer: billing.NewMailer(), Dialect: idempotency.PostgreSQL})
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: billing.Consumer.Name, DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: gochannel.NewGoChannel(gochannel.Config{}, nil), Topic: "billing.dlq"},
	}, nil)
	require.NoError(t, err)
	r := idempotencytest.Explore(t, idempotencytest.Subject{
		Handler:  svc.HandleOrderPlaced,
		Consumer: c,
		Effects:  func(context.Context, *message.Message) (int, error) { return provider.Charges(), nil },
	}, placed(t, "o-explore", "1.000"))
	require.NotEmpty(t, r.Statements)
	require.Empty(t, r.Divergences)
	require.Equal(t, 1, provider.Charges())
}
