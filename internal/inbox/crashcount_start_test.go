package inbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// lostAnswers is the crash count's connection while the network flaps:
// each statement reaches the server and commits, but while lose > 0 its
// answer is lost on the way back (the connection broke after the server
// committed), so the call fails.
type lostAnswers struct {
	sqldb.Querier
	lose atomic.Int32
}

var errAnswerLost = errors.New("test: connection reset after the statement committed")

func (q *lostAnswers) lost() bool {
	for {
		n := q.lose.Load()
		if n <= 0 {
			return false
		}
		if q.lose.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

func (q *lostAnswers) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	n, err := q.Querier.Exec(ctx, query, args...)
	if err == nil && q.lost() {
		return 0, errAnswerLost
	}
	return n, err
}

func (q *lostAnswers) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	return lostRow{row: q.Querier.QueryRow(ctx, query, args...), q: q}
}

type lostRow struct {
	row sqldb.Row
	q   *lostAnswers
}

func (r lostRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...) // the statement ran and committed
	if err == nil && r.q.lost() {
		return errAnswerLost
	}
	return err
}

// A redelivered message held through a flapping database is never counted
// as crashing (docs/guarantees.md: "a delivery held through an outage ends
// its attempts normally and is never counted"): here, four times, the
// crash count's start reaches the database and commits but its answer is
// lost, and the attempt's own connection cannot be had; then the database
// is back. Nothing crashed: the event must be applied once, not
// dead-lettered as a crash loop.
func TestRedeliveryHeldWhileCrashCountAnswersAreLostIsNotACrashLoop(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var away atomic.Int32 // acquires still to fail on the attempt's pool
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 4)
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		for {
			n := away.Load()
			if n <= 0 {
				return true, nil
			}
			if away.CompareAndSwap(n, n-1) {
				return true, errors.New("test: the database is unreachable")
			}
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	counts := &lostAnswers{Querier: sqldb.Pgx(e.pool)}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
		MaxCrashes: 3, CrashQuerier: counts,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 8)}
	var calls atomic.Int32
	h := chainedHold(t, idem, poison, watermill.NopLogger{}, 20*time.Second, func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	})

	const outages = 4
	counts.lose.Store(outages)
	away.Store(outages)
	msg := newMsg(uuid.Must(uuid.NewV7()).String())
	marshaler.SetRedelivered(msg, true) // as RabbitMQ marks a redelivery after a lost ack
	_, err = h(msg)
	require.NoError(t, err)

	require.Zero(t, len(poison.msgs), "a delivery held through a flapping database was dead-lettered")
	require.Equal(t, int32(1), calls.Load(), "the handler ran once")
	var effects, left int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM effect`).Scan(&effects))
	require.Equal(t, 1, effects, "the effect was not applied once")
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "no crash count is left behind")
}
