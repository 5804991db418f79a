package middleware_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	idempotency "github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// TestJoinedAttemptOutlivingTheAckDeadlineCommitsNothingAndComesAgain:
// with JoinSQLSubscriber, the attempt's transaction is watermill-sql's
// subscriber transaction. When a handler runs past the subscriber's
// AckDeadline (30 s by default; 1 s here), watermill-sql gives up on the
// message, ends its context and COMMITs its batch transaction while the
// attempt still runs. That COMMIT fails on the attempt's running row:
// nothing of the attempt is committed, the message comes again and its
// effects are applied once, whole. On the old code the claim and the
// debit committed and the redelivery was a duplicate: the credit was never
// applied. Two handler shapes, each writing the debit first, then busy
// outside the database until the subscriber ended its transaction: one
// returns the context's error, one returns nil (the credit is written by a
// later delivery only).
//
// The consumer runs in a child process whose race reports are not fatal:
// watermill-sql v4.1.2 commits on its own goroutine a transaction whose
// connection the attempt used on the handler's, with nothing ordering the
// two once the message's context ended (the race detector reports pgx's
// connection state), whatever the library does.
func TestJoinedAttemptOutlivingTheAckDeadlineCommitsNothingAndComesAgain(t *testing.T) {
	if v := os.Getenv(joinedDeadlineChildEnv); v != "" {
		os.Exit(joinedDeadlineChild(v == "returns-nil"))
	}
	for _, name := range []string{"returns-the-context-error", "returns-nil"} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			pool, schema := testenv.Pool(t)
			require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
			_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
			require.NoError(t, err)
			pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(pool), wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
			require.NoError(t, err)
			m, err := newEventErr()
			require.NoError(t, err)
			require.NoError(t, pub.Publish("orders", m))

			cmd := exec.Command(os.Args[0], "-test.run=^TestJoinedAttemptOutlivingTheAckDeadlineCommitsNothingAndComesAgain$")
			cmd.Env = append(os.Environ(), joinedDeadlineChildEnv+"="+name, joinedDeadlineSchemaEnv+"="+schema,
				"GORACE=halt_on_error=0 exitcode=0 log_path="+filepath.Join(t.TempDir(), "race"))
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, "%s", out)
			require.Contains(t, string(out), "calls=", "%s", out)

			count := func(q string) int {
				var n int
				require.NoError(t, pool.QueryRow(ctx, q).Scan(&n))
				return n
			}
			require.Equal(t, 1, count(`SELECT count(*) FROM effect WHERE note = 'credit'`),
				"the credit is applied once: on the old code the subscriber committed the claim with the debit alone and the redelivery was a duplicate (%s)", out)
			require.Equal(t, 1, count(`SELECT count(*) FROM effect WHERE note = 'debit'`), "the debit is applied once")
			require.Equal(t, 1, count(`SELECT (SELECT count(*) FROM processed_event) + (SELECT count(*) FROM processed_event_v7)`), "one claim")
			require.Contains(t, string(out), "calls=2", "the message came again once")
		})
	}
}

const (
	joinedDeadlineChildEnv  = "IDEMPOTENCY_JOINED_DEADLINE_CHILD"
	joinedDeadlineSchemaEnv = "IDEMPOTENCY_JOINED_DEADLINE_SCHEMA"
)

// joinedDeadlineChild consumes the queue of the parent's schema until the
// credit is applied (at most 30 s), then prints the handler's calls.
func joinedDeadlineChild(returnsNil bool) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, err); return 2 }
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv(joinedDeadlineSchemaEnv)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	logger := watermill.NopLogger{}
	ackDeadline := time.Second
	sub, err := queueSubscriber(wsql.BeginnerFromPgx(pool), &ackDeadline, logger)
	if err != nil {
		return fail(err)
	}
	poison := newGoChannel()
	defer poison.Close()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool), JoinSQLSubscriber: true,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		Retry:  middleware.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
	}, logger)
	if err != nil {
		return fail(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return fail(err)
	}
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", sub, func(msg *message.Message) error {
		n := calls.Add(1)
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		var pid int
		if err := tx.QueryRow(msg.Context(), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'debit')`, msg.UUID); err != nil {
			return err
		}
		if n == 1 { // the first attempt is slow (an external call, a busy CPU, a lock elsewhere)
			<-msg.Context().Done()
			// Still busy until the subscriber ended its transaction (at
			// most 10 s).
			for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
				var open bool
				if pool.QueryRow(ctx, `SELECT xact_start IS NOT NULL FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&open) == nil && !open {
					break
				}
			}
			if returnsNil {
				return nil
			}
			return msg.Context().Err()
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'credit')`, msg.UUID)
		return err
	})
	if err != nil {
		return fail(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	<-r.Running()
	// Until the credit is committed (the subscriber commits after the
	// ack), at most 30 s.
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if pool.QueryRow(ctx, `SELECT 1 FROM effect WHERE note = 'credit'`).Scan(new(int)) == nil {
			break
		}
	}
	cancel()
	if err := <-done; err != nil {
		return fail(err)
	}
	fmt.Printf("calls=%d\n", calls.Load())
	return 0
}

// queueSubscriber is watermill-sql's subscriber on its PostgreSQL queue
// schema, polling every 20 ms, with ackDeadline (nil: watermill-sql's
// default, 30 s).
func queueSubscriber(b wsql.Beginner, ackDeadline *time.Duration, logger watermill.LoggerAdapter) (*wsql.Subscriber, error) {
	return wsql.NewSubscriber(b, wsql.SubscriberConfig{
		SchemaAdapter: wsql.PostgreSQLQueueSchema{}, OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{},
		InitializeSchema: true, AckDeadline: ackDeadline,
		PollInterval: 20 * time.Millisecond, ResendInterval: 10 * time.Millisecond,
	}, logger)
}

func newConsumerEnvPoison(t *testing.T) message.Publisher {
	ps := newGoChannel()
	t.Cleanup(func() { _ = ps.Close() })
	return ps
}

func newGoChannel() *gochannel.GoChannel {
	return gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})
}

func newEventErr() (*message.Message, error) {
	return marshaler.NewMessage("order.placed", map[string]string{"order_id": "o-1"})
}

// TestJoinedAttemptRunningWhenTheSubscriberClosesCommitsNothing: a
// shutdown that closes the watermill-sql subscriber while a handler runs
// (Subscriber.Close before Router.Close, or the router's own close of its
// subscribers) makes watermill-sql COMMIT its batch transaction while the
// attempt runs. That COMMIT fails on the attempt's running row: neither
// the claim nor the write made so far is committed, so the next process
// applies the event whole (on the old code the claim committed with the
// debit alone, and the credit was lost).
func TestJoinedAttemptRunningWhenTheSubscriberClosesCommitsNothing(t *testing.T) {
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
	require.NoError(t, err)
	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromPgx(pool)
	sub, err := queueSubscriber(beginner, nil, logger)
	require.NoError(t, err)
	require.NoError(t, sub.SubscribeInitialize("orders"))
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}}, logger)
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: db, JoinSQLSubscriber: true,
		Poison: middleware.PoisonConfig{Publisher: newConsumerEnvPoison(t), Topic: "poison"},
	}, logger)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	inHandler, closed, returned := make(chan struct{}, 1), make(chan struct{}), make(chan struct{}, 1)
	_, err = c.AddConsumerHandler(r, "reserve", "orders", sub, func(msg *message.Message) error {
		defer func() { returned <- struct{}{} }()
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'debit')`, msg.UUID); err != nil {
			return err
		}
		inHandler <- struct{}{}
		<-closed // slow work outside the database, past the subscriber's close
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'credit')`, msg.UUID)
		return err
	})
	require.NoError(t, err)
	runRouter(t, r)
	m, err := newEventErr()
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", m))
	<-inHandler
	require.NoError(t, sub.Close()) // the service shuts down; Close waits for the subscriber's COMMIT
	close(closed)
	<-returned

	var debit, credit, claims int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE note = 'debit'), count(*) FILTER (WHERE note = 'credit') FROM effect`).Scan(&debit, &credit))
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM processed_event) + (SELECT count(*) FROM processed_event_v7)`).Scan(&claims))
	require.Equal(t, []int{0, 0, 0}, []int{claims, debit, credit}, "nothing of the running attempt is committed (claims, debits, credits)")
}
