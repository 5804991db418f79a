package outbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// TestRelayBackPressure: the broker pushing back is never the row's fault,
// and a publish that hangs is bounded, visible and holds no transaction, on
// every database.
func TestRelayBackPressure(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		t.Run("HangingPublishBounded", func(t *testing.T) { testHangingPublish(t, newBox(t, tg)) })
		t.Run("BackPressureNeverDeadLetters", func(t *testing.T) { testBackPressureClassified(t, newBox(t, tg)) })
	})
}

// hangingSink is a publisher blocked inside Publish (ignoring its
// context, as watermill-amqp v3 waiting for a confirm on a connection the
// broker blocked) until release is closed; then it takes the message.
type hangingSink struct {
	sink
	calls   atomic.Int64
	first   atomic.Int64 // UnixNano of the first call
	release chan struct{}
}

func (h *hangingSink) Publish(topic string, msgs ...*message.Message) error {
	if h.calls.Add(1) == 1 {
		h.first.Store(time.Now().UnixNano())
	}
	<-h.release
	return h.sink.Publish(topic, msgs...)
}

// pgActivity watches the relay's own PostgreSQL sessions (a pool of their
// own with an application_name): open transactions are seen in
// pg_stat_activity. Nil on the other databases.
type pgActivity struct {
	app  string
	pool *pgxpool.Pool
}

func relayDB(t *testing.T, b *box) (wsql.Beginner, *pgActivity) {
	t.Helper()
	if b.tg.Pgx == nil {
		return b.db, nil
	}
	app := testenv.UniqueName("relay")
	pool, err := pgxpool.New(context.Background(), testenv.SchemaURL(b.tg.Database)+"&application_name="+app)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return wsql.BeginnerFromPgx(pool), &pgActivity{app: app, pool: pool}
}

// openTx counts the relay's sessions idle inside a transaction for more
// than 250 ms (a transaction held across a publish, which hangs for
// PublishTimeout). The instants between the statements of its short claim
// and settle transactions are not counted, nor its statements in flight.
func (a *pgActivity) openTx(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, a.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%' AND now() - state_change > interval '250 milliseconds' AND pid <> pg_backend_pid()`, a.app).Scan(&n))
	return n
}

// A publish that never returns: after PublishTimeout the relay gives up on
// it (back-pressure, ErrPublishTimeout logged, nothing counted against the
// row), calls the publisher no more while it is inside (no pile-up of
// stuck goroutines), keeps its stats and reports the stall within
// StalledAfter, with no database transaction open. When the publisher
// returns, the row is published (again: at least once) and removed.
func testHangingPublish(t *testing.T, b *box) {
	start := time.Now()
	x := newID()
	b.write(t, "events", x)
	h := &hangingSink{release: make(chan struct{})}
	released := false
	t.Cleanup(func() {
		if !released {
			close(h.release)
		}
	})
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	db, activity := relayDB(t, b)
	rb := &box{table: b.table, tg: b.tg, ob: ob, db: db}
	rec := &counts{}
	const timeout, stalledAfter = 500 * time.Millisecond, 700 * time.Millisecond
	rb.relay(t, h, outbox.RelayConfig{PublishTimeout: timeout, StalledAfter: stalledAfter, StatsInterval: 20 * time.Millisecond,
		MaxAttempts: 1, RetryInterval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Recorder: rec})

	logged := func(match func(watermill.CapturedMessage) bool) bool {
		for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
			if match(e) {
				return true
			}
		}
		return false
	}
	eventually(t, 10*time.Second, func() bool { return h.calls.Load() >= 1 }, "the publish started")
	hung := time.Unix(0, h.first.Load())
	var timedOutAt, stalledAt time.Duration
	// Bounds, not timings: each is seen, within a slack that only an
	// unbounded wait exceeds (a loaded machine delays the log by more than
	// a stats interval).
	const slack = 5 * time.Second
	for (timedOutAt == 0 || stalledAt == 0) && time.Since(hung) < stalledAfter+slack {
		if activity != nil {
			require.Zero(t, activity.openTx(t), "no transaction open while the publish hangs")
		}
		if timedOutAt == 0 && logged(func(e watermill.CapturedMessage) bool { return errors.Is(e.Err, outbox.ErrPublishTimeout) }) {
			timedOutAt = time.Since(hung)
		}
		if stalledAt == 0 && logged(func(e watermill.CapturedMessage) bool { return errors.Is(e.Err, outbox.ErrStalled) }) {
			stalledAt = time.Since(start)
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.NotZero(t, timedOutAt, "the bound was hit and logged")
	require.Less(t, timedOutAt, timeout+slack, "within PublishTimeout of the publish's start")
	require.NotZero(t, stalledAt, "stall warning")
	require.Less(t, stalledAt, stalledAfter+slack, "stall warning within StalledAfter (+ a stats interval) of the write")
	t.Logf("publish gave up after %s (PublishTimeout %s); stall logged %s after the write (StalledAfter %s)",
		timedOutAt.Round(time.Millisecond), timeout, stalledAt.Round(time.Millisecond), stalledAfter)
	require.Greater(t, rec.oldest.Load(), int64(stalledAfter), "the oldest pending age is reported meanwhile")
	require.EqualValues(t, 1, h.calls.Load(), "no publish piled up behind the stuck one")
	require.GreaterOrEqual(t, rec.pressure.Load(), int64(1), "counted as back-pressure")
	require.Zero(t, rec.dead.Load(), "MaxAttempts 1, yet nothing dead-lettered")

	close(h.release)
	released = true
	eventually(t, 30*time.Second, func() bool { return h.count(x) >= 1 && b.pending(t) == 0 }, "published once the publisher returns")
	n, err := b.ob.DeadLetters(context.Background())
	require.NoError(t, err)
	require.Zero(t, n)
}

// errFull is a publish error the user's classifier calls back-pressure (as
// watermill-amqp's nack of a full queue).
var errFull = errors.New("delivery not confirmed: queue full")

// Every publish to one topic is pushed back (BackPressure) for many
// rounds while another topic flows (so the broker is up): with MaxAttempts
// 1, nothing is dead-lettered and the rows keep 0 attempts; once the
// pressure is gone they are published in order.
func testBackPressureClassified(t *testing.T, b *box) {
	full := []string{newID(), newID(), newID()}
	b.write(t, "full", full...)
	var mu sync.Mutex
	pushBack := true
	s := &sink{}
	s.refuse = func(topic string, _ *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if pushBack && topic == "full" {
			return errFull
		}
		return nil
	}
	rec := &counts{}
	b.relay(t, s, outbox.RelayConfig{MaxAttempts: 1, RetryInterval: time.Millisecond, MaxBackoff: 10 * time.Millisecond, Recorder: rec,
		BackPressure: func(err error) bool { return errors.Is(err, errFull) }})
	for i := 0; i < 5; i++ {
		b.write(t, "other", newID())
	}
	eventually(t, 30*time.Second, func() bool { return rec.pressure.Load() >= 10 && len(s.all()) == 5 }, "pushed back many times while the other topic flows")
	require.Zero(t, rec.dead.Load())
	var counted int
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+b.tg.Quote(b.table)+` WHERE attempts > 0`).Scan(&counted))
	require.Zero(t, counted, "back-pressure is not the rows' attempts")
	mu.Lock()
	pushBack = false
	mu.Unlock()
	eventually(t, 30*time.Second, func() bool { return b.pending(t) == 0 }, "published once the pressure is gone")
	var got []string
	for _, g := range s.all() {
		if g.topic == "full" {
			got = append(got, g.uuid)
		}
	}
	require.Equal(t, full, got, "in order, once each")
	require.Zero(t, rec.dead.Load())
}
