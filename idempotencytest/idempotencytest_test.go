package idempotencytest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// fakeTB records what the helpers report.
type fakeTB struct {
	mu   sync.Mutex
	errs []string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, fmt.Sprintf(format, args...))
}

func (f *fakeTB) all() string { return strings.Join(f.errs, "\n") }

var _ idempotencytest.TB = (*testing.T)(nil)

type fixture struct {
	pool   *pgxpool.Pool
	db     idempotency.DB
	poison *gochannel.GoChannel
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL)`)
	require.NoError(t, err)
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, nil)
	t.Cleanup(func() { _ = ps.Close() })
	return &fixture{pool: pool, db: db, poison: ps}
}

func (f *fixture) consumer(t *testing.T, name string) *middleware.Consumer {
	t.Helper()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: name, DB: f.db,
		Poison: middleware.PoisonConfig{Publisher: f.poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{MaxRetries: 1, InitialInterval: time.Millisecond},
	}, nil)
	require.NoError(t, err)
	return c
}

// handler writes one effect row in the attempt's transaction.
func (f *fixture) handler(msg *message.Message) error {
	tx, ok := middleware.PgxTxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction")
	}
	_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID)
	return err
}

func (f *fixture) effects(ctx context.Context, msg *message.Message) (int, error) {
	var n int
	err := f.pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, msg.UUID).Scan(&n)
	return n, err
}

func (f *fixture) subject(c *middleware.Consumer) idempotencytest.Subject {
	return idempotencytest.Subject{
		Handler:  idempotencytest.NoPublish(f.handler),
		Consumer: c,
		Effects:  f.effects,
	}
}

func newMsg() *message.Message {
	return message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
}

func TestDeliverTwice(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c := f.consumer(t, "c")
	r := idempotencytest.DeliverTwice(t, f.subject(c), newMsg())
	require.Equal(t, idempotencytest.Report{Deliveries: 2, Calls: 1, Effects: 1}, r)

	// What the helper reports when the effect count is not the expected one.
	tb := &fakeTB{}
	s := f.subject(c)
	s.WantEffects = 2
	r = idempotencytest.DeliverTwice(tb, s, newMsg())
	require.Equal(t, 1, r.Effects)
	require.Contains(t, tb.all(), "1 effects after 2 deliveries")
}

// A handler whose first attempt fails (an error or a panic after its
// write, rolled back) and is retried in place is entered twice: DeliverTwice
// reports it, saying why, since an effect outside the transaction (an
// external call) would have happened twice (found by a new user's trial
// and a review).
func TestDeliverTwiceReportsAnAttemptRetriedInPlace(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c := f.consumer(t, "c")
	for _, fail := range []string{"error", "panic"} {
		var entered atomic.Int32
		s := f.subject(c)
		s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
			if err := f.handler(msg); err != nil {
				return err
			}
			if entered.Add(1) == 1 {
				if fail == "panic" {
					panic("first attempt")
				}
				return middleware.Transient(errors.New("first attempt"))
			}
			return nil
		})
		tb := &fakeTB{}
		r := idempotencytest.DeliverTwice(tb, s, newMsg())
		require.Contains(t, tb.all(), "handler entered 2 times", fail)
		require.Contains(t, tb.all(), "retried in place", fail)
		require.Equal(t, 1, r.Effects, fail)
	}
}

func TestDeliverConcurrently(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c := f.consumer(t, "c")
	r := idempotencytest.DeliverConcurrently(t, f.subject(c), newMsg(), 8)
	require.Equal(t, 8, r.Deliveries)
	require.Equal(t, 1, r.Calls)
	require.Equal(t, 1, r.Effects)

	tb := &fakeTB{}
	idempotencytest.DeliverConcurrently(tb, f.subject(c), newMsg(), 1)
	require.Contains(t, tb.all(), "want ≥ 2")
}

func TestSubjectValidation(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	c := f.consumer(t, "c")
	for name, s := range map[string]idempotencytest.Subject{
		"Subject.Handler":  {Consumer: c, Effects: f.effects},
		"Subject.Consumer": {Handler: idempotencytest.NoPublish(f.handler), Effects: f.effects},
		"Subject.Effects":  {Handler: idempotencytest.NoPublish(f.handler), Consumer: c},
	} {
		tb := &fakeTB{}
		idempotencytest.DeliverTwice(tb, s, newMsg())
		require.Contains(t, tb.all(), name)
	}
}

// A handler that panics is recovered, retried and poisoned by the chain:
// the helper reports the entries and the missing effect.
func TestPanicIsReported(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	s.Handler = func(*message.Message) ([]*message.Message, error) { panic("boom") }
	tb := &fakeTB{}
	r := idempotencytest.DeliverTwice(tb, s, newMsg())
	require.Zero(t, r.Effects)
	require.GreaterOrEqual(t, r.Calls, 2)
	require.Contains(t, tb.all(), "0 effects after 2 deliveries")
}

// Deliver returns what the router would see: nil for a processed or a
// poisoned message, the handler's class of error otherwise.
func TestDeliverReturnsWhatTheRouterSees(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	s := f.subject(f.consumer(t, "c"))
	_, err := idempotencytest.Deliver(s, newMsg())
	require.NoError(t, err)
	s.Handler = func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("bad payload"))
	}
	_, err = idempotencytest.Deliver(s, newMsg())
	require.NoError(t, err, "poisoned and acked")
	_, err = idempotencytest.Deliver(idempotencytest.Subject{}, newMsg())
	require.ErrorContains(t, err, "Subject.Consumer")
}

type observations struct {
	mu  sync.Mutex
	obs []middleware.Observation
}

func (o *observations) RecordOutcome(ob middleware.Observation) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.obs = append(o.obs, ob)
}

// Subject.Consumer's doc: the helpers attach the consumer "to a handler
// named "idempotencytest"": the attempts are observed (and logged, and
// dead-lettered) under that name, as a router's context gives it, not an
// empty one.
func TestDeliverNamesTheHandlerIdempotencytest(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	rec := &observations{}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "named", DB: f.db, Recorder: rec,
		Poison: middleware.PoisonConfig{Publisher: f.poison, Topic: "poison"},
	}, nil)
	require.NoError(t, err)
	_, err = idempotencytest.Deliver(f.subject(c), newMsg())
	require.NoError(t, err)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.NotEmpty(t, rec.obs)
	require.Equal(t, "idempotencytest", rec.obs[0].HandlerName)
}
