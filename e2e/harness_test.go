package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// Event ids of the numbered cases (valid UUIDv7).
const (
	E1 = "01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b"
	E2 = "01906dbc-ad01-70b2-9b2c-3d4e5f6a7b8c"
	E3 = "01906dbc-ad02-70c3-ac3d-4e5f6a7b8c9d"
)

// testConsumer is the consumer of the generic tests: it receives both order
// events; its effect is one row in "effect".
var testConsumer = shop.Consumer{Name: "stock", Bindings: []string{shop.EventOrderPlaced, shop.EventOrderStatusChanged}}

const effectSchema = `
CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL);
CREATE TABLE calls (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`

// env is one test's database schema and broker topology.
type env struct {
	t        *testing.T
	pool     *pgxpool.Pool
	dbURL    string // the PostgreSQL server holding schema
	schema   string
	topo     shop.Topology
	consumer shop.Consumer
	conn     *amqp091.Connection
}

func newEnv(t *testing.T, c shop.Consumer) *env {
	t.Helper()
	return newEnvAt(t, c, testenv.PostgresURL())
}

// newEnvAt is newEnv on the PostgreSQL server at dbURL (a private server
// of testenv.StartPostgres).
func newEnvAt(t *testing.T, c shop.Consumer, dbURL string) *env {
	t.Helper()
	schema := testenv.SchemaOn(t, dbURL)
	pool := testenv.PoolAt(t, dbURL, schema, 8)
	ctx := context.Background()
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, effectSchema)
	require.NoError(t, err)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable (start it: rabbitmq-server -detached)", testenv.AMQPURL())
	e := &env{t: t, pool: pool, dbURL: dbURL, schema: schema, consumer: c, conn: conn,
		topo: shop.Topology{Prefix: testenv.UniqueName("e2e") + ".", Prefetch: 4}}
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, e.topo.Declare(ch, c))
	require.NoError(t, ch.Close())
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = e.topo.Delete(ch, c)
		}
		_ = conn.Close()
	})
	return e
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

func (e *env) effects(id string) int {
	return e.count(`SELECT count(*) FROM effect WHERE event_id = $1`, id)
}

func (e *env) processed(id string) int {
	return e.count(`SELECT count(*) FROM (`+claimsSQL+`) x WHERE event_id = $1`, id)
}

func (e *env) calls(id string) int {
	return e.count(`SELECT count(*) FROM calls WHERE event_id = $1`, id)
}

// ready is the number of ready messages in queue.
func (e *env) ready(queue string) int {
	e.t.Helper()
	ch, err := e.conn.Channel()
	require.NoError(e.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(e.t, err)
	return q.Messages
}

// drain takes every message out of queue.
func (e *env) drain(queue string) []amqp091.Delivery {
	e.t.Helper()
	ch, err := e.conn.Channel()
	require.NoError(e.t, err)
	defer ch.Close()
	var out []amqp091.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		require.NoError(e.t, err)
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// publishRaw publishes body as is to the events exchange, with confirms.
func (e *env) publishRaw(routingKey string, body []byte) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	require.NoError(e.t, err)
	defer ch.Close()
	require.NoError(e.t, ch.Confirm(false))
	conf, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.topo.ExchangeName(), routingKey, false, false,
		amqp091.Publishing{DeliveryMode: amqp091.Persistent, Body: body})
	require.NoError(e.t, err)
	ok, err := conf.WaitContext(context.Background())
	require.NoError(e.t, err)
	require.True(e.t, ok)
}

// publisher is a watermill-amqp events publisher with amqpmarshaler.Marshaler.
func (e *env) publisher() *wamqp.Publisher {
	e.t.Helper()
	pub, err := wamqp.NewPublisher(e.topo.PublisherConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(e.t, err)
	e.t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// publishEvent publishes the event id with name and payload through pub.
func (e *env) publishEvent(pub message.Publisher, id, name string, payload any) {
	e.t.Helper()
	msg, err := marshaler.NewMessageWithID(uuid.MustParse(id), name, time.Now().UTC(), payload)
	require.NoError(e.t, err)
	require.NoError(e.t, pub.Publish(name, msg))
}

// effectHandler is the test consumer's handler: it records the call on its
// own connection (committed at once, whatever happens to the attempt), then
// writes one effect row in the attempt's transaction.
func effectHandler(pool *pgxpool.Pool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := pool.Exec(ctx, `INSERT INTO calls (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		tx, ok := inbox.PgxTxFromContext(ctx)
		if !ok {
			return inbox.Permanent(fmt.Errorf("no transaction"))
		}
		_, err := tx.Exec(ctx, `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID)
		return err
	}
}

// delivery is one delivery seen by a probe.
type delivery struct {
	uuid        string
	redelivered bool
	malformed   bool
	err         error
}

// probe is an outermost middleware recording every delivery and its result.
type probe struct {
	mu  sync.Mutex
	got []delivery
}

func (p *probe) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		_, bad := marshaler.Malformed(msg)
		d := delivery{uuid: msg.UUID, redelivered: marshaler.Redelivered(msg), malformed: bad}
		out, err := h(msg)
		d.err = err
		p.mu.Lock()
		p.got = append(p.got, d)
		p.mu.Unlock()
		return out, err
	}
}

func (p *probe) deliveries() []delivery {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]delivery(nil), p.got...)
}

func (p *probe) of(id string) []delivery {
	var out []delivery
	for _, d := range p.deliveries() {
		if d.uuid == id {
			out = append(out, d)
		}
	}
	return out
}

// recorder counts the idempotent middleware's outcomes.
type recorder = idempotencytest.Outcomes

// logEntry is one captured log line.
type logEntry struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

// captureLogger records every log line at every level.
type captureLogger struct {
	mu      *sync.Mutex
	entries *[]logEntry
	fields  watermill.LogFields
}

func newCaptureLogger() captureLogger {
	return captureLogger{mu: &sync.Mutex{}, entries: &[]logEntry{}}
}

func (l captureLogger) add(level, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.entries = append(*l.entries, logEntry{level: level, msg: msg, err: err, fields: l.fields.Add(f)})
}

func (l captureLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add("error", msg, err, f)
}
func (l captureLogger) Info(msg string, f watermill.LogFields)  { l.add("info", msg, nil, f) }
func (l captureLogger) Debug(msg string, f watermill.LogFields) { l.add("debug", msg, nil, f) }
func (l captureLogger) Trace(msg string, f watermill.LogFields) { l.add("trace", msg, nil, f) }
func (l captureLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return captureLogger{mu: l.mu, entries: l.entries, fields: l.fields.Add(f)}
}

func (l captureLogger) all() []logEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]logEntry(nil), *l.entries...)
}

func (l captureLogger) errors() []logEntry {
	var out []logEntry
	for _, e := range l.all() {
		if e.level == "error" {
			out = append(out, e)
		}
	}
	return out
}

// consumerOpts configures startConsumer.
type consumerOpts struct {
	subscriberURL string // "" → the broker directly
	handler       message.NoPublishHandlerFunc
	middleware    []message.HandlerMiddleware
	recorder      middleware.Recorder
	logger        watermill.LoggerAdapter
	pool          *pgxpool.Pool // "" → e.pool
	workers       int
}

// newService builds the consumer service of env-like parameters; shared by
// the tests and the child processes.
func newService(pool *pgxpool.Pool, topo shop.Topology, c shop.Consumer, o consumerOpts) (*shop.Service, error) {
	if o.handler == nil {
		o.handler = effectHandler(pool)
	}
	return shop.NewService(shop.ServiceConfig{
		AMQPURL:       testenv.AMQPURL(),
		SubscriberURL: o.subscriberURL,
		Topology:      topo,
		Consumer:      c,
		Pool:          pool,
		Handler:       o.handler,
		Workers:       o.workers,
		Middleware:    o.middleware,
		Idempotency: middleware.ConsumerConfig{Recorder: o.recorder,
			Retry: middleware.RetryConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 200 * time.Millisecond, MaxRetries: 3}},
		Logger: o.logger,
	})
}

// startConsumer starts the env's consumer service; it is closed when the
// test ends (or earlier by the test).
func (e *env) startConsumer(o consumerOpts) *shop.Service {
	e.t.Helper()
	pool := o.pool
	if pool == nil {
		pool = e.pool
	}
	svc, err := newService(pool, e.topo, e.consumer, o)
	require.NoError(e.t, err)
	done := make(chan error, 1)
	go func() { done <- svc.Run(context.Background()) }()
	e.t.Cleanup(func() {
		_ = svc.Close()
		<-done
	})
	select {
	case <-svc.Running():
	case err := <-done:
		e.t.Fatalf("consumer stopped: %v", err)
	case <-time.After(15 * time.Second):
		e.t.Fatal("consumer did not start within 15 s")
	}
	return svc
}

// eventually polls cond every 10 ms until it holds or timeout passes; the
// failure says what it waited for and what cond saw last (testenv.Eventually).
func eventually(t *testing.T, timeout time.Duration, what string, cond func(o *testenv.Observed) bool) {
	t.Helper()
	testenv.Eventually(t, timeout, what, cond)
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// claimsSQL selects each claim once, whichever table holds it: processed
// migration 8 puts UUIDv7 events in processed_event_v7, and a claim the
// table's trigger copied is in both.
const claimsSQL = `SELECT consumer, event_id FROM processed_event
UNION SELECT c.name, v.event_id FROM processed_event_v7 v JOIN processed_event_consumer c ON c.id = v.consumer`
