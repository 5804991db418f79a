package newuser_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// names are the only thing changed from the README's runStock: the README
// hard-codes the exchange "events", the queue "stock.events", the poison
// topic "stock.events.dlq" and the consumer "stock", which a test on the
// shared broker must not use.
type names struct {
	Exchange string // "events"
	Queue    string // "stock.events"
	DLQ      string // "stock.events.dlq"
	Consumer string // "stock"
	Topic    string // "order.order.placed.v1"
	Handler  string // "reserve_stock"
}

// wiring is how a variant deviates from the README (the mistakes a
// newcomer makes). The zero value is the README as written.
type wiring struct {
	// retry changes the consumer's RetryConfig (a shorter hold for tests).
	retry func(*middleware.RetryConfig)
	// skipMigrate forgets processed.Migrate.
	skipMigrate bool
	// pool changes the pool's config (a fault proxy in front of PostgreSQL).
	pool func(*pgxpool.Config)
	// handler replaces the body after the README's JSON decoding, with the
	// attempt's transaction; nil: the README's INSERT.
	handler func(msg *message.Message, orderID string) error
	// subscriber changes the subscriber's config after the README's lines
	// (a line forgotten).
	subscriber func(*amqp.Config)
}

// runStock is the README's "Using it" snippet, copied as a newcomer copies
// it, with the names and the wiring variant as parameters.
func runStock(ctx context.Context, amqpURL, databaseURL string, logger watermill.LoggerAdapter, n names, w wiring) error {
	pcfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return err
	}
	if w.pool != nil {
		w.pool(pcfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := idempotency.Pgx(pool)
	if !w.skipMigrate {
		if err := processed.Migrate(ctx, db, processed.Config{}); err != nil { // or processed.MigrationsFS with goose / golang-migrate
			return err
		}
	}

	subCfg := amqp.NewDurableTopicConfig(amqpURL, n.Exchange, n.Queue)
	subCfg.Exchange.Durable = true
	subCfg.Queue.Arguments = amqp091.Table{"x-queue-type": "quorum"}
	subCfg.Marshaler = idamqp.Marshaler{}
	if w.subscriber != nil {
		w.subscriber(&subCfg)
	}
	subscriber, err := amqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	dl := idamqp.DeadLetterConfig{Subscriber: subCfg, Topic: n.DLQ, Quorum: true}
	poisonCfg, err := idamqp.DeclareDeadLetter(dl)
	if err != nil {
		return err
	}
	poison, err := idamqp.NewConfirmedPublisher(poisonCfg, logger)
	if err != nil {
		return err
	}
	defer poison.Close()

	cfg := middleware.ConsumerConfig{
		Consumer:      n.Consumer, // the claim key's name, shared by every worker of this consumer
		DB:            db,
		ReplayHorizon: 7 * 24 * time.Hour,
		Poison:        middleware.PoisonConfig{Publisher: poison, Topic: dl.PoisonTopic()},
	}
	if w.retry != nil {
		w.retry(&cfg.Retry)
	}
	c, err := middleware.NewConsumer(cfg, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	_, err = c.AddConsumerHandler(router, n.Handler, n.Topic, subscriber, func(msg *message.Message) error {
		var order struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return middleware.Permanent(err) // poisoned at once, never retried
		}
		if w.handler != nil {
			return w.handler(msg, order.OrderID)
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context()) // the attempt's transaction, claim included
		_, err := tx.Exec(msg.Context(), `INSERT INTO reservation (order_id) VALUES ($1)`, order.OrderID)
		return err // nil: commit, ack; error: rollback, retry, then poison
	})
	if err != nil {
		return err
	}
	return router.Run(ctx)
}

// env is one test's world: a schema on the shared PostgreSQL with the
// reservation table, unique AMQP names, a publisher on the exchange and a
// broker connection for inspection; everything removed at the end.
type env struct {
	t      *testing.T
	n      names
	dbURL  string
	pool   *pgxpool.Pool
	schema string
	conn   *amqp091.Connection
	pub    *amqp.Publisher
	queues []string
	logs   *capture
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return newEnvOn(t, testenv.PostgresURL())
}

// newEnvOn is newEnv on the PostgreSQL server at dbURL (a private one).
func newEnvOn(t *testing.T, dbURL string) *env {
	t.Helper()
	schema := testenv.SchemaOn(t, dbURL)
	pool := testenv.PoolAt(t, dbURL, schema, 8)
	e := &env{t: t, pool: pool, schema: schema, logs: &capture{}}
	e.dumpOnFailure()
	e.dbURL = withSearchPath(dbURL, schema)
	e.n = names{
		Exchange: testenv.UniqueName("nc_events"),
		Queue:    testenv.UniqueName("nc_stock.events"),
		Consumer: "stock",
		Topic:    "order.order.placed.v1",
		Handler:  "reserve_stock",
	}
	e.n.DLQ = e.n.Queue + ".dlq"
	e.queues = []string{e.n.Queue, e.n.DLQ}
	e.exec(`CREATE TABLE reservation (order_id text NOT NULL, note text NOT NULL DEFAULT '')`)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s unreachable: %v", testenv.AMQPURL(), err)
	}
	e.conn = conn
	pcfg := amqp.NewDurableTopicConfig(testenv.AMQPURL(), e.n.Exchange, "")
	pcfg.Exchange.Durable = true
	pcfg.Marshaler = idamqp.Marshaler{}
	pcfg.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(pcfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	e.pub = pub
	t.Cleanup(func() {
		_ = pub.Close()
		ch, err := conn.Channel()
		if err == nil {
			for _, q := range e.queues {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			_ = ch.ExchangeDelete(e.n.Exchange, false, false)
			_ = ch.ExchangeDelete(e.n.DLQ, false, false)
			_ = ch.Close()
		}
		_ = conn.Close()
	})
	return e
}

func withSearchPath(dbURL, schema string) string {
	u, err := url.Parse(dbURL)
	if err != nil {
		panic(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// start runs the service in the background until the test ends (or stop).
func (e *env) start(n names, w wiring) (stop func() error) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runStock(ctx, testenv.AMQPURL(), e.dbURL, e.logs, n, w) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(60 * time.Second):
				err = fmt.Errorf("service did not stop within 60 s")
			}
		})
		return err
	}
	e.t.Cleanup(func() { _ = stop() })
	// The queue is bound once the subscriber consumes from it.
	testenv.Eventually(e.t, 30*time.Second, "the service consumes from its queue "+n.Queue, func(o *testenv.Observed) bool {
		select {
		case err := <-done:
			e.t.Fatalf("service stopped at start: %v", err)
		default:
		}
		return o.Int("consumers", e.consumers(n.Queue)) >= 1
	})
	return stop
}

// depth is the number of ready messages in q (false when q does not exist).
func (e *env) depth(q string) (int, bool) {
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		return 0, false
	}
	return st.Messages, true
}

// consumers is the number of consumers of q (0 when q does not exist).
func (e *env) consumers(q string) int {
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		return 0
	}
	return st.Consumers
}

// unacked is ready + unacknowledged messages of q (management-free: a
// consumer-less passive declare counts only ready ones, so this needs the
// consumers gone).
func (e *env) settled(q string) bool {
	n, ok := e.depth(q)
	return ok && n == 0
}

// order publishes the event "order placed" for orderID, copies times, with
// one event id (a relay republish, a replay, a lost-confirm retry).
func (e *env) order(orderID string, copies int) string {
	e.t.Helper()
	msg, err := marshaler.NewMessage("order.order.placed.v1", map[string]string{"order_id": orderID})
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i < copies; i++ {
		c := msg.Copy()
		if err := e.pub.Publish(e.n.Topic, c); err != nil {
			e.t.Fatalf("publish: %v", err)
		}
	}
	return msg.UUID
}

// raw publishes body as is on the exchange with the handler's routing key.
func (e *env) raw(body []byte) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish(e.n.Exchange, e.n.Topic, true, false, amqp091.Publishing{Body: body, DeliveryMode: amqp091.Persistent}); err != nil {
		e.t.Fatalf("raw publish: %v", err)
	}
}

// reservations is the number of reservation rows of orderID.
func (e *env) reservations(orderID string) int {
	return e.count(`SELECT count(*) FROM reservation WHERE order_id = $1`, orderID)
}

// capture is a LoggerAdapter that keeps every line (and prints nothing).
type capture struct {
	mu    sync.Mutex
	lines []logLine
}

type logLine struct {
	level, msg string
	err        error
	fields     watermill.LogFields
}

func (c *capture) add(level, msg string, err error, f watermill.LogFields) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines = append(c.lines, logLine{level, msg, err, f})
}

func (c *capture) Error(msg string, err error, f watermill.LogFields) { c.add("ERROR", msg, err, f) }
func (c *capture) Info(msg string, f watermill.LogFields)             { c.add("INFO", msg, nil, f) }
func (c *capture) Debug(msg string, f watermill.LogFields)            { c.add("DEBUG", msg, nil, f) }
func (c *capture) Trace(msg string, f watermill.LogFields)            { c.add("TRACE", msg, nil, f) }
func (c *capture) With(f watermill.LogFields) watermill.LoggerAdapter {
	return &withFields{c: c, f: f}
}

type withFields struct {
	c *capture
	f watermill.LogFields
}

func (w *withFields) Error(msg string, err error, f watermill.LogFields) {
	w.c.add("ERROR", msg, err, w.f.Add(f))
}
func (w *withFields) Info(msg string, f watermill.LogFields)  { w.c.add("INFO", msg, nil, w.f.Add(f)) }
func (w *withFields) Debug(msg string, f watermill.LogFields) { w.c.add("DEBUG", msg, nil, w.f.Add(f)) }
func (w *withFields) Trace(msg string, f watermill.LogFields) { w.c.add("TRACE", msg, nil, w.f.Add(f)) }
func (w *withFields) With(f watermill.LogFields) watermill.LoggerAdapter {
	return &withFields{c: w.c, f: w.f.Add(f)}
}

// errors returns the ERROR lines whose message or error text contains sub.
func (c *capture) errors(sub string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, l := range c.lines {
		if l.level != "ERROR" {
			continue
		}
		text := l.msg
		if l.err != nil {
			text += ": " + l.err.Error()
		}
		text += fmt.Sprint(" ", l.fields)
		if strings.Contains(text, sub) {
			out = append(out, text)
		}
	}
	return out
}

// all returns every line at level (all levels when "").
func (c *capture) all(level string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, l := range c.lines {
		if level != "" && l.level != level {
			continue
		}
		text := l.level + " " + l.msg
		if l.err != nil {
			text += ": " + l.err.Error()
		}
		out = append(out, text+fmt.Sprint(" ", l.fields))
	}
	return out
}

// dumpOnFailure prints the service's log lines when the test failed.
func (e *env) dumpOnFailure() {
	e.t.Cleanup(func() {
		if !e.t.Failed() {
			return
		}
		lines := e.logs.all("")
		if len(lines) > 200 {
			lines = append(lines[:100], lines[len(lines)-100:]...)
		}
		for _, l := range lines {
			if len(l) > 600 {
				l = l[:600] + "…"
			}
			e.t.Log(l)
		}
	})
}

// settledDeliveries counts the deliveries the service finished with an ack
// of its own: processed, skipped as duplicates, or poisoned.
func (c *capture) settledDeliveries() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, l := range c.lines {
		switch l.msg {
		case "Event processed", "Event skipped", "Message poisoned":
			n++
		}
	}
	return n
}
