package e2e_test

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/processed"
)

var placedPayload = map[string]any{"order_id": "o-42", "quantity": "2.000"}

// TestPoisonEnvelopesDoNotLoop (C03) — poison envelopes must not loop: six bad bodies then a valid E1,
// through the real broker. Each bad one is delivered once, never reaches the
// handler, and sits once in the dead-letter queue with its reason; E1 is
// processed.
func TestPoisonEnvelopesDoNotLoop(t *testing.T) {
	t.Parallel()
	e := newEnv(t, testConsumer)
	p := &probe{}
	e.startConsumer(consumerOpts{middleware: []message.HandlerMiddleware{p.middleware}})

	occurred := `"occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":"o-42","quantity":"2.000"}`
	bad := []string{
		``,
		`{"event_id":`,
		`{"event_name":"order.placed",` + occurred + `}`,
		`{"event_id":"not-a-uuid","event_name":"order.placed",` + occurred + `}`,
		`{"event_id":"","event_name":"order.placed",` + occurred + `}`,
		`{"event_id":12345,"event_name":"order.placed",` + occurred + `}`,
	}
	for _, b := range bad {
		e.publishRaw(shop.EventOrderPlaced, []byte(b))
	}
	e.publishEvent(e.publisher(), E1, shop.EventOrderPlaced, placedPayload)

	dlq := e.topo.DeadLetterQueue(e.consumer)
	eventually(t, 15*time.Second, "E1 processed and six messages dead-lettered", func(o *testenv.Observed) bool {
		return o.Int("effects(E1)", e.effects(E1)) == 1 && o.Int("deliveries", len(p.deliveries())) == 7 && o.Int("ready(dlq)", e.ready(dlq)) == 6
	})

	var malformed int
	for _, d := range p.deliveries() {
		require.False(t, d.redelivered, "never requeued: %+v", d)
		require.NoError(t, d.err, "poisoned messages are acked: %+v", d)
		if d.malformed {
			malformed++
		}
	}
	require.Equal(t, 6, malformed)
	require.Equal(t, 1, e.count(`SELECT count(*) FROM calls`), "the handler ran for E1 only")
	require.Equal(t, 1, e.calls(E1))
	require.Equal(t, 1, e.count(`SELECT count(*) FROM (`+claimsSQL+`) x`), "no claim for a bad message")

	bodies := map[string]int{}
	for _, d := range e.drain(dlq) {
		bodies[string(d.Body)]++
		reason, _ := d.Headers[wmw.ReasonForPoisonedKey].(string)
		require.Contains(t, reason, "malformed", "reason header of %q", d.Body)
		require.Equal(t, "true", d.Headers[marshaler.MetadataMalformed])
		require.NotEmpty(t, d.Headers[marshaler.MetadataMalformedReason])
	}
	for _, b := range bad {
		require.Equal(t, 1, bodies[b], "body %q once in the dead-letter queue, unchanged", b)
	}
	require.Equal(t, 0, e.ready(e.topo.Queue(e.consumer)))
}

// germanLocale is the non-English lc_messages of C06's second run.
const germanLocale = "de_DE.UTF-8"

// germanServer starts a private PostgreSQL server whose messages are German
// (lc_messages=de_DE.UTF-8, the locale compiled into the server's own
// directory: the shared server is neither restarted nor reconfigured, no
// system locale is added) and checks that they are: SELECT 1/0 fails with
// SQLSTATE 22012 "Division durch Null".
func germanServer(t *testing.T) *testenv.Postgres {
	t.Helper()
	pg := testenv.StartPostgres(t, "lc_messages="+germanLocale)
	ctx := context.Background()
	pool := testenv.PoolAt(t, pg.URL, "public", 1)
	_, err := pool.Exec(ctx, "SELECT 1/0")
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22012", pgErr.Code)
	require.Equal(t, "Division durch Null", pgErr.Message, "the private server answers in German")
	return pg
}

// TestLostAckAfterCommitIsSkippedOnRedelivery (C06) — the ack is lost after the commit: E1's handler commits, then the
// consumer dies (SIGKILL in a child process at crashpoint.AfterCommit) or
// its AMQP connection is cut (fault proxy) before the ack reaches the
// broker. The broker redelivers E1 with redelivered=true; the claim inserts
// nothing, the handler is skipped, the delivery is acked, nothing is logged
// as an error.
func TestLostAckAfterCommitIsSkippedOnRedelivery(t *testing.T) {
	t.Parallel()
	t.Run("kill", func(t *testing.T) {
		t.Parallel()
		c06Kill(t, testenv.PostgresURL(), "")
	})
	t.Run("kill_lc_messages", func(t *testing.T) {
		t.Parallel()
		c06Kill(t, germanServer(t).URL, germanLocale)
	})
	t.Run("cut", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, testConsumer)
		uri, err := amqp091.ParseURI(testenv.AMQPURL())
		require.NoError(t, err)
		proxy, err := faultproxy.Start(net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		uri.Host, uri.Port = "127.0.0.1", proxy.Port()

		p, rec, logger := &probe{}, &recorder{}, newCaptureLogger()
		var once sync.Once
		cutAfterCommit := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && rec.Count(inbox.OutcomeProcessed) == 1 {
					once.Do(proxy.Cut) // committed; the router's ack cannot reach the broker
				}
				return out, err
			}
		}
		svc := e.startConsumer(consumerOpts{
			subscriberURL: uri.String(),
			middleware:    []message.HandlerMiddleware{p.middleware, cutAfterCommit},
			recorder:      rec,
			logger:        logger,
		})
		e.publishEvent(e.publisher(), E1, shop.EventOrderPlaced, placedPayload)
		eventually(t, 15*time.Second, "E1 redelivered after the cut", func(o *testenv.Observed) bool { return o.Int("deliveries(E1)", len(p.of(E1))) == 2 })
		require.NoError(t, svc.Close())
		require.False(t, p.of(E1)[0].redelivered)
		assertC06(t, e, p.of(E1)[1], rec, logger)
	})
}

// c06Kill runs C06 with the consumer killed, on the PostgreSQL server at
// dbURL, its sessions' lc_messages set to lc unless lc is "".
func c06Kill(t *testing.T, dbURL, lc string) {
	e := newEnvAt(t, testConsumer, dbURL)
	e.publishEvent(e.publisher(), E1, shop.EventOrderPlaced, placedPayload)
	spawn(t, "consumer", "DATABASE_URL="+dbURL, "E2E_SCHEMA="+e.schema, "E2E_PREFIX="+e.topo.Prefix, "E2E_CRASH="+crashpoint.AfterCommit, "E2E_LC="+lc)
	require.Equal(t, 1, e.processed(E1), "committed before the kill")
	require.Equal(t, 1, e.effects(E1))
	queue := e.topo.Queue(e.consumer)
	eventually(t, 15*time.Second, "the broker requeues the unacked E1", func(o *testenv.Observed) bool { return o.Int("ready(queue)", e.ready(queue)) == 1 })

	pool := e.pool
	if lc != "" {
		cfg := testenv.PoolConfig(t, dbURL, e.schema, 4)
		cfg.ConnConfig.RuntimeParams["lc_messages"] = lc
		var err error
		pool, err = pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
	}
	p, rec, logger := &probe{}, &recorder{}, newCaptureLogger()
	svc := e.startConsumer(consumerOpts{
		pool:       pool,
		handler:    effectHandler(pool),
		middleware: []message.HandlerMiddleware{p.middleware},
		recorder:   rec,
		logger:     logger,
	})
	eventually(t, 15*time.Second, "E1 redelivered to the restarted consumer", func(o *testenv.Observed) bool { return o.Int("deliveries(E1)", len(p.of(E1))) == 1 })
	require.NoError(t, svc.Close()) // waits for the ack
	assertC06(t, e, p.of(E1)[0], rec, logger)
}

// assertC06 checks the end state of C06: the redelivery of E1 was flagged
// redelivered, skipped as a duplicate and acked; one call, one claim, one
// effect; queues empty; no error logged; the skip logged (debug) with
// outcome "duplicate".
func assertC06(t *testing.T, e *env, redelivery delivery, rec *recorder, logger captureLogger) {
	t.Helper()
	require.True(t, redelivery.redelivered, "RabbitMQ flags the copy redelivered")
	require.NoError(t, redelivery.err)
	require.Equal(t, 1, rec.Count(inbox.OutcomeDuplicate))
	require.Equal(t, 1, e.calls(E1))
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 0, e.ready(e.topo.Queue(e.consumer)), "acked")
	require.Equal(t, 0, e.ready(e.topo.DeadLetterQueue(e.consumer)))
	require.Empty(t, logger.errors(), "nothing logged as an error")
	require.Zero(t, rec.Count(inbox.OutcomeFailed), "the redelivery never failed an attempt")
	require.Zero(t, rec.Count(inbox.OutcomeRejected))
	// The case: "the skip is logged at info/debug". Count the lines per
	// level: exactly one line with outcome=duplicate, at info or debug (not
	// trace, which production loggers drop, not error).
	levels := map[string]int{}
	for _, l := range logger.all() {
		if l.fields["outcome"] == string(inbox.OutcomeDuplicate) {
			levels[l.level]++
		}
	}
	require.Equal(t, 1, levels["debug"]+levels["info"], "the skip is logged once at info/debug: %v", levels)
	require.Len(t, levels, 1, "and at no other level: %v", levels)
}

// TestKilledBetweenClaimAndCommitIsProcessedOnRestart (C01 D) — the consumer is killed with SIGKILL after the claim and before
// COMMIT, then restarted: the claim died with the transaction, the
// redelivery is processed. At crashpoint.AfterClaim the handler had not run
// yet (calls 1 in all); at crashpoint.BeforeCommit it had (calls 2, the
// case's expectation).
func TestKilledBetweenClaimAndCommitIsProcessedOnRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		point string
		calls int
	}{{crashpoint.AfterClaim, 1}, {crashpoint.BeforeCommit, 2}} {
		t.Run(tc.point, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, testConsumer)
			e.publishEvent(e.publisher(), E1, shop.EventOrderPlaced, placedPayload)
			spawn(t, "consumer", "E2E_SCHEMA="+e.schema, "E2E_PREFIX="+e.topo.Prefix, "E2E_CRASH="+tc.point)
			require.Equal(t, 0, e.processed(E1), "the claim rolled back with the killed transaction")
			require.Equal(t, 0, e.effects(E1))
			require.Equal(t, tc.calls-1, e.calls(E1))
			queue := e.topo.Queue(e.consumer)
			eventually(t, 15*time.Second, "the broker requeues the unacked E1", func(o *testenv.Observed) bool { return o.Int("ready(queue)", e.ready(queue)) == 1 })

			p, rec := &probe{}, &recorder{}
			svc := e.startConsumer(consumerOpts{middleware: []message.HandlerMiddleware{p.middleware}, recorder: rec})
			eventually(t, 15*time.Second, "E1 processed after the restart", func(o *testenv.Observed) bool {
				return o.Int("processed", rec.Count(inbox.OutcomeProcessed)) == 1
			})
			require.NoError(t, svc.Close())
			require.True(t, p.of(E1)[0].redelivered)
			require.Equal(t, tc.calls, e.calls(E1))
			require.Equal(t, 1, e.processed(E1))
			require.Equal(t, 1, e.effects(E1))
			require.Equal(t, 0, e.ready(queue), "E1 acked once")
			require.Equal(t, 0, e.ready(e.topo.DeadLetterQueue(e.consumer)))
		})
	}
}

// Out-of-order status events through the broker: v3, v1, v2 of one order,
// each its own event. The copy ends at v3; v1 and v2 are stale, acked,
// recorded as processed, never dead-lettered.
func TestOutOfOrderStatusEvents(t *testing.T) {
	t.Parallel()
	e := newEnv(t, shipping.Consumer)
	require.NoError(t, shipping.Migrate(context.Background(), e.pool, processed.Config{}))
	h, err := shipping.NewHandler()
	require.NoError(t, err)
	rec := &recorder{}
	svc := e.startConsumer(consumerOpts{handler: h.Handle, recorder: rec})
	pub := e.publisher()
	e.publishEvent(pub, E3, shop.EventOrderStatusChanged, shop.OrderStatusChanged{OrderID: "o-1", Version: 3, Status: "shipped"})
	e.publishEvent(pub, E1, shop.EventOrderPlaced, shop.OrderPlaced{OrderID: "o-1", Version: 1, Status: "placed",
		Lines: []shop.OrderLine{{LineNo: 1, SKU: "s", Quantity: "1"}}})
	e.publishEvent(pub, E2, shop.EventOrderStatusChanged, shop.OrderStatusChanged{OrderID: "o-1", Version: 2, Status: "packed"})
	eventually(t, 15*time.Second, "three events processed or stale", func(o *testenv.Observed) bool {
		return o.Int("processed", rec.Count(inbox.OutcomeProcessed))+o.Int("stale", rec.Count(inbox.OutcomeStale)) == 3
	})
	require.NoError(t, svc.Close())
	require.Equal(t, 2, rec.Count(inbox.OutcomeStale))
	var version int64
	var status string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT version, status FROM order_status_copy WHERE order_id = 'o-1'`).Scan(&version, &status))
	require.Equal(t, int64(3), version)
	require.Equal(t, "shipped", status)
	require.Equal(t, 3, e.count(`SELECT count(*) FROM (`+claimsSQL+`) x`))
	require.Equal(t, 0, e.ready(e.topo.Queue(e.consumer)), "stale events acked")
	require.Equal(t, 0, e.ready(e.topo.DeadLetterQueue(e.consumer)))
}
