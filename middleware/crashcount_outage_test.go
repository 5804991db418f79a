package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// poisonRecorder is a poison publisher that keeps what it was given.
type poisonRecorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *poisonRecorder) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *poisonRecorder) Close() error { return nil }

func (p *poisonRecorder) reasons() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var r []string
	for _, m := range p.msgs {
		r = append(r, m.Metadata.Get("reason_poisoned"))
	}
	return r
}

// poisoningConsumer is a pgx consumer named name on pool whose dead letters
// go to poison, retried fast and held at most 3 s: a test sees within
// seconds whether a delivery is poisoned, retried or given back.
func poisoningConsumer(t *testing.T, pool *pgxpool.Pool, name string, poison *poisonRecorder) *middleware.Consumer {
	t.Helper()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: name, DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: 3 * time.Second},
	}, nil)
	require.NoError(t, err)
	return c
}

// The docs promise that database outages neither poison nor dead-letter,
// and (ConsumerConfig.MaxCrashes, docs/guarantees.md) that "a delivery held
// through an outage ends its attempts normally and is never counted" as a
// crash. Here a redelivered message (AMQP's redelivered bit) is held
// while the database flaps: three times the database goes away during the
// handler and is still away when the attempt ends, then it is back for
// good. Nothing crashed; the delivery must be applied once and never
// dead-lettered as a crash loop.
func TestRedeliveryHeldThroughRepeatedOutagesIsNotDeadLetteredAsCrashLoop(t *testing.T) {
	_, schema := testenv.Pool(t)
	var unreachable atomic.Int32 // acquires still to fail: the database is away
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 8)
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		if unreachable.Load() > 0 {
			unreachable.Add(-1)
			return true, errors.New("test: the database is unreachable")
		}
		return true, nil
	}
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)

	poison := &poisonRecorder{}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: db,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, nil)
	require.NoError(t, err)

	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if calls.Add(1) <= 3 {
			// The database goes away under the handler (its session is
			// terminated) and is still away when the attempt ends.
			unreachable.Store(1)
			_, err := tx.Exec(msg.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
			return nil, err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	require.NoError(t, err)

	msg := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	marshaler.SetRedelivered(msg, true) // as RabbitMQ marks a redelivery after a lost ack
	_, err = h(msg)
	require.NoError(t, err)

	require.Empty(t, poison.reasons(), "a delivery held through database outages was dead-lettered")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 1, effects, "the effect was not applied once")
}

// An end the database could not take is written by the process's next
// attempt of any event (ConsumerConfig.MaxCrashes): a redelivered message
// is held while the database is away under its handler, and the delivery
// is given back (its message context ends, as at a shutdown or when the
// hold runs out and the broker hands it to another replica) before the
// database is back. The next attempt this process runs, of another event,
// must write the owed end: otherwise the count stayed, and each replica
// that held the event through an outage added a crash it never had.
func TestEndOwedByADeliveryGivenBackIsWrittenByTheNextAttemptOfAnyEvent(t *testing.T) {
	_, schema := testenv.Pool(t)
	var away atomic.Bool
	var refused atomic.Int32
	var giveBack atomic.Pointer[context.CancelFunc]
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 8)
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		if away.Load() {
			if refused.Add(1) == 3 {
				if c := giveBack.Load(); c != nil {
					(*c)()
				}
			}
			return false, errors.New("test: the database is unreachable")
		}
		return true, nil
	}
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)

	poison := &poisonRecorder{}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: db,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, nil)
	require.NoError(t, err)
	held := uuid.Must(uuid.NewV7()).String()
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if msg.UUID == held {
			away.Store(true)
			_, err := tx.Exec(msg.Context(), `SELECT pg_terminate_backend(pg_backend_pid())`)
			return nil, err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})
	require.NoError(t, err)
	started := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(started), 0) FROM processed_event_crash WHERE event_id = $1`, held).Scan(&n))
		return n
	}

	msgCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	giveBack.Store(&cancel)
	msg := message.NewMessage(held, []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	marshaler.SetRedelivered(msg, true)
	msg.SetContext(msgCtx)
	_, err = h(msg)
	require.Error(t, err, "the delivery was not given back")
	giveBack.Store(nil)
	away.Store(false)
	require.Equal(t, 1, started(), "the held attempt's start was not written, so this test checks nothing")

	other := message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
	other.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	_, err = h(other)
	require.NoError(t, err)
	require.Zero(t, started(), "the end owed for the delivery given back was not written by the next attempt")
	require.Empty(t, poison.reasons())
}
