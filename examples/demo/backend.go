package main

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	_ "modernc.org/sqlite" // the pure-Go SQLite driver of the embedded backend

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
)

// The demo's two backends.
const (
	// backendServices is PostgreSQL (DATABASE_URL) and RabbitMQ (AMQP_URL).
	backendServices = "services"
	// backendEmbedded is SQLite files in a temporary directory and the
	// shop's in-process broker (Watermill's GoChannel): nothing to install.
	backendEmbedded = "embedded"
)

// defaultBackend is services when DATABASE_URL or AMQP_URL is set, else
// embedded.
func defaultBackend() string {
	if os.Getenv("DATABASE_URL") != "" || os.Getenv("AMQP_URL") != "" {
		return backendServices
	}
	return backendEmbedded
}

func (d *demo) embedded() bool { return d.cfg.Backend == backendEmbedded }

// broker is what the demo needs of the message broker beyond the services'
// shop.Transport: the relays' destination, the consumers' transports with
// a way to lose their acks, raw publishing and the final inspection.
type broker interface {
	// publisher is the events publisher of the relays and the replays.
	publisher() message.Publisher
	// transport is c's broker, and cut loses the acks of c's deliveries in
	// flight (the broker redelivers them).
	transport(c shop.Consumer) (t shop.Transport, cut func(), err error)
	// publishRaw publishes body as is, with message id id, to the events
	// exchange with routing key (event name) key.
	publishRaw(ctx context.Context, key, id string, body []byte) error
	// queued is the number of messages of c's queue not yet acked.
	queued(c shop.Consumer) (int, error)
	// drainDeadLetters takes every message out of c's dead letters.
	drainDeadLetters(c shop.Consumer) (dlqContent, error)
	// reconciling is the number of messages in c's reconciliation queue.
	reconciling(c shop.Consumer) (int, error)
}

// amqpBroker is RabbitMQ with the run's topology; each consumer's
// subscriber goes through a TCP fault proxy that cut closes.
type amqpBroker struct {
	d    *demo
	conn *amqp091.Connection
	topo shop.Topology
	pub  *wamqp.Publisher
}

func (d *demo) newAMQPBroker(all []shop.Consumer) (*amqpBroker, error) {
	b := &amqpBroker{d: d, topo: shop.Topology{Prefix: "demo_" + d.id + ".", Prefetch: d.cfg.Prefetch}}
	var err error
	b.conn, err = amqp091.Dial(d.cfg.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s unreachable: %w (start it, or set AMQP_URL)", d.cfg.AMQPURL, err)
	}
	d.defer_(func() { _ = b.conn.Close() })
	ch, err := b.conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := b.topo.Declare(ch, all...); err != nil {
		return nil, err
	}
	_ = ch.Close()
	if !d.cfg.Keep {
		d.defer_(func() {
			if ch, err := b.conn.Channel(); err == nil {
				_ = b.topo.Delete(ch, all...)
				_ = ch.Close()
			}
		})
	}
	b.pub, err = wamqp.NewPublisher(b.topo.PublisherConfig(d.cfg.AMQPURL), d.logger)
	if err != nil {
		return nil, fmt.Errorf("relay publisher: %w", err)
	}
	d.defer_(func() { _ = b.pub.Close() })
	return b, nil
}

func (b *amqpBroker) publisher() message.Publisher { return b.pub }

func (b *amqpBroker) transport(c shop.Consumer) (shop.Transport, func(), error) {
	uri, err := amqp091.ParseURI(b.d.cfg.AMQPURL)
	if err != nil {
		return nil, nil, fmt.Errorf("AMQP_URL: %w", err)
	}
	proxy, err := faultproxy.Start(net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	if err != nil {
		return nil, nil, err
	}
	b.d.defer_(func() { _ = proxy.Close() })
	uri.Host, uri.Port = "127.0.0.1", proxy.Port()
	return shop.AMQPTransport{URL: b.d.cfg.AMQPURL, SubscriberURL: uri.String(), Topology: b.topo}, proxy.Cut, nil
}

func (b *amqpBroker) publishRaw(ctx context.Context, key, id string, body []byte) error {
	ch, err := b.conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, b.topo.ExchangeName(), key, false, false,
		amqp091.Publishing{MessageId: id, DeliveryMode: amqp091.Persistent, Body: body})
	if err != nil {
		return err
	}
	if ok, err := conf.WaitContext(ctx); err != nil || !ok {
		return fmt.Errorf("malformed message %s not confirmed: %v", id, err)
	}
	return nil
}

func (b *amqpBroker) passive(queue string) (int, error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return q.Messages, nil
}

func (b *amqpBroker) queued(c shop.Consumer) (int, error) { return b.passive(b.topo.Queue(c)) }

func (b *amqpBroker) reconciling(c shop.Consumer) (int, error) {
	return b.passive(b.topo.ReconcileQueue(c))
}

func (b *amqpBroker) drainDeadLetters(c shop.Consumer) (dlqContent, error) {
	got := dlqContent{byID: map[string]int{}, withReason: map[string]int{}}
	ch, err := b.conn.Channel()
	if err != nil {
		return got, err
	}
	defer ch.Close()
	for {
		m, ok, err := ch.Get(b.topo.DeadLetterQueue(c), true)
		if err != nil {
			return got, err
		}
		if !ok {
			return got, nil
		}
		got.total++
		got.byID[m.MessageId]++
		if reason, _ := m.Headers[wmw.ReasonForPoisonedKey].(string); reason != "" {
			got.withReason[m.MessageId]++
		}
	}
}

// channelBroker is the shop's in-process broker.
type channelBroker struct{ b *shop.ChannelBroker }

func (d *demo) newChannelBroker(all []shop.Consumer) (*channelBroker, error) {
	b := shop.NewChannelBroker(d.logger)
	d.defer_(func() { _ = b.Close() })
	if err := b.Declare(all...); err != nil {
		return nil, err
	}
	return &channelBroker{b: b}, nil
}

func (b *channelBroker) publisher() message.Publisher { return b.b.Publisher() }

func (b *channelBroker) transport(c shop.Consumer) (shop.Transport, func(), error) {
	return b.b, func() { b.b.Cut(c) }, nil
}

func (b *channelBroker) publishRaw(_ context.Context, key, id string, body []byte) error {
	return b.b.PublishRaw(key, id, body)
}

func (b *channelBroker) queued(c shop.Consumer) (int, error) { return b.b.Queued(c) }

func (b *channelBroker) reconciling(c shop.Consumer) (int, error) { return b.b.Reconciling(c) }

func (b *channelBroker) drainDeadLetters(c shop.Consumer) (dlqContent, error) {
	got := dlqContent{byID: map[string]int{}, withReason: map[string]int{}}
	dead, err := b.b.DrainDeadLetters(c)
	for _, m := range dead {
		got.total++
		got.byID[m.MessageID]++
		if m.Headers[wmw.ReasonForPoisonedKey] != "" {
			got.withReason[m.MessageID]++
		}
	}
	return got, err
}

// newDB returns the database of one service: on PostgreSQL the schema
// "demo_<id>_<service>" (dropped at the end unless -keep) and a pool of at
// most maxConns connections whose search_path is that schema; embedded, the
// SQLite file "<service>.db" in the run's directory, whose name in the
// checks (ATTACH) is the same "demo_<id>_<service>".
func (d *demo) newDB(ctx context.Context, service string, maxConns int32) (shop.DB, string, error) {
	schema := "demo_" + d.id + "_" + strings.ReplaceAll(service, "-", "_")
	if d.embedded() {
		db, err := d.sqliteFile(service, int(maxConns))
		if err != nil {
			return shop.DB{}, "", err
		}
		d.attached = append(d.attached, attachment{path: filepath.Join(d.dir, service+".db"), schema: schema})
		return shop.SQLiteDB(db), schema, nil
	}
	if _, err := d.admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return shop.DB{}, "", err
	}
	if !d.cfg.Keep {
		d.defer_(func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, _ = d.admin.Exec(c, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
		})
	}
	pool, err := d.poolOn(ctx, schema, maxConns)
	return shop.PgxDB(pool), schema, err
}

// poolOn returns another pool on schema, closed at the end.
func (d *demo) poolOn(ctx context.Context, schema string, maxConns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(d.cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	pc.ConnConfig.RuntimeParams["search_path"] = schema
	pc.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, err
	}
	d.defer_(pool.Close)
	return pool, nil
}

// sqliteFile opens (creating it) the SQLite file name+".db" of the run's
// directory, closed at the end.
func (d *demo) sqliteFile(name string, maxConns int) (*sql.DB, error) {
	db, err := sql.Open("sqlite", shop.SQLiteDSN(filepath.Join(d.dir, name+".db"))+"&_pragma=synchronous(NORMAL)")
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(maxConns)
	d.defer_(func() { _ = db.Close() })
	if err := db.Ping(); err != nil {
		return nil, fmt.Errorf("SQLite %s: %w", name, err)
	}
	return db, nil
}

// attachment is one service's SQLite file and its name in the checks.
type attachment struct{ path, schema string }

// checker runs the checks' queries: on PostgreSQL on the admin pool, which
// sees every schema; embedded on one SQLite connection with every service's
// file attached under its schema's name.
type checker interface {
	one(ctx context.Context, q string, args ...any) (int, error)
	query(ctx context.Context, q string, args []any, each func(scan func(...any) error) error) error
}

type pgChecker struct{ pool *pgxpool.Pool }

func (c pgChecker) one(ctx context.Context, q string, args ...any) (int, error) {
	var n int
	err := c.pool.QueryRow(ctx, q, args...).Scan(&n)
	return n, err
}

func (c pgChecker) query(ctx context.Context, q string, args []any, each func(scan func(...any) error) error) error {
	return shop.PgxDB(c.pool).Query(ctx, q, args, each)
}

// sqliteChecker rewrites the checks' PostgreSQL text where SQLite spells it
// otherwise ($n placeholders, ::int casts).
type sqliteChecker struct{ conn *sql.Conn }

var placeholder = regexp.MustCompile(`\$[0-9]+`)

func sqliteText(q string) string {
	return strings.ReplaceAll(placeholder.ReplaceAllString(q, "?"), "::int", "")
}

func (c sqliteChecker) one(ctx context.Context, q string, args ...any) (int, error) {
	var n sql.NullInt64
	err := c.conn.QueryRowContext(ctx, sqliteText(q), args...).Scan(&n)
	return int(n.Int64), err
}

func (c sqliteChecker) query(ctx context.Context, q string, args []any, each func(scan func(...any) error) error) error {
	rows, err := c.conn.QueryContext(ctx, sqliteText(q), args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// newChecker returns the checks' connection.
func (d *demo) newChecker(ctx context.Context) (checker, error) {
	if !d.embedded() {
		return pgChecker{d.admin}, nil
	}
	db, err := d.sqliteFile("checks", 1)
	if err != nil {
		return nil, err
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	d.defer_(func() { _ = conn.Close() })
	for _, a := range d.attached {
		if _, err := conn.ExecContext(ctx, `ATTACH DATABASE ? AS `+a.schema, a.path); err != nil {
			return nil, fmt.Errorf("attach %s: %w", a.path, err)
		}
	}
	return sqliteChecker{conn}, nil
}
