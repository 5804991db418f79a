package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// statuses are the status changes applied to every order, in order.
var statuses = []string{"packed", "shipped", "delivered"}

// malformedBodies are the bodies of case C03, published raw.
var malformedBodies = [][]byte{
	[]byte(``),
	[]byte(`{"event_id":`),
	[]byte(`{"event_name":"order.order.placed.v1","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":"o-42","quantity":"2.000"}}`),
	[]byte(`{"event_id":"not-a-uuid","event_name":"order.order.placed.v1","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":"o-42","quantity":"2.000"}}`),
	[]byte(`{"event_id":"","event_name":"order.order.placed.v1","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":"o-42","quantity":"2.000"}}`),
	[]byte(`{"event_id":12345,"event_name":"order.order.placed.v1","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":"o-42","quantity":"2.000"}}`),
}

// recorder counts the idempotent middleware's outcomes of one consumer.
type recorder struct {
	processed, duplicate, stale, failed, rejected atomic.Int64
}

var _ middleware.Recorder = (*recorder)(nil)

func (r *recorder) RecordOutcome(o middleware.Observation) {
	switch o.Outcome {
	case middleware.OutcomeProcessed:
		r.processed.Add(1)
	case middleware.OutcomeDuplicate:
		r.duplicate.Add(1)
	case middleware.OutcomeStale:
		r.stale.Add(1)
	case middleware.OutcomeFailed:
		r.failed.Add(1)
	default:
		r.rejected.Add(1)
	}
}

// consumerRun is one consumer service of the run.
type consumerRun struct {
	consumer shop.Consumer
	pool     *pgxpool.Pool
	schema   string
	probe    *consumerProbe
	rec      *recorder
	svc      *shop.Service
	proxy    *faultproxy.Proxy
	done     chan error
}

type demo struct {
	cfg    config
	stdout io.Writer
	stderr io.Writer
	logger watermill.LoggerAdapter
	rng    *lockedRand

	id          string
	admin       *pgxpool.Pool
	orderSchema string
	orderPool   *pgxpool.Pool
	orders      *order.Service
	topo        shop.Topology
	amqpConn    *amqp091.Connection
	stock       *consumerRun
	shipping    *consumerRun
	shipHandler *shipping.Handler

	relay     *order.Relay
	relayDone chan error
	relayPub  *wamqp.Publisher
	reorder   *reorderingPublisher
	flaky     *flakyOffsets

	placed, changed  atomic.Int64
	malformedIDs     []string
	prodStart        time.Time
	prodEnd          time.Time
	replayFrom       time.Time
	replayTo         time.Time
	replayed         int
	settled          bool
	started          time.Time
	cleanups         []func()
	progressStop     chan struct{}
	progressDone     chan struct{}
	progressTerminal bool
}

// run executes one demo run and prints its report; it returns the exit
// status (0 ok, 1 not ok, 2 could not run).
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	d := &demo{cfg: cfg, stdout: stdout, stderr: stderr, rng: newLockedRand(cfg.Seed), started: time.Now()}
	d.logger = watermill.NopLogger{}
	if cfg.Verbose {
		d.logger = watermill.NewStdLoggerWithOut(stderr, false, false)
	}
	defer d.cleanup()
	res, err := d.run(ctx)
	d.stopProgress()
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 2
	}
	res.print(stdout)
	if !res.OK {
		return 1
	}
	return 0
}

func (d *demo) defer_(f func()) { d.cleanups = append(d.cleanups, f) }

func (d *demo) cleanup() {
	for i := len(d.cleanups) - 1; i >= 0; i-- {
		d.cleanups[i]()
	}
}

func (d *demo) run(ctx context.Context) (*result, error) {
	if err := d.setup(ctx); err != nil {
		return nil, err
	}
	d.startProgress()
	if err := d.produce(ctx); err != nil {
		return nil, err
	}
	if err := d.replay(ctx); err != nil {
		return nil, err
	}
	d.settled = d.waitSettled(ctx)
	d.stopProgress()
	if err := d.shutdown(); err != nil {
		return nil, err
	}
	return d.check(ctx)
}

func randomID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// setup creates the run's schemas, tables, broker topology, services and
// relay, and starts them.
func (d *demo) setup(ctx context.Context) error {
	d.id = randomID()
	var err error
	d.admin, err = pgxpool.New(ctx, d.cfg.DatabaseURL)
	if err != nil {
		return fmt.Errorf("PostgreSQL %s: %w", d.cfg.DatabaseURL, err)
	}
	d.defer_(d.admin.Close)
	if err := d.admin.Ping(ctx); err != nil {
		return fmt.Errorf("PostgreSQL at %s unreachable: %w (start it, or set DATABASE_URL)", d.cfg.DatabaseURL, err)
	}

	newPool := func(service string, maxConns int32) (*pgxpool.Pool, string, error) {
		schema := "demo_" + d.id + "_" + service
		if _, err := d.admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
			return nil, "", err
		}
		if !d.cfg.Keep {
			d.defer_(func() {
				c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				_, _ = d.admin.Exec(c, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
			})
		}
		pc, err := pgxpool.ParseConfig(d.cfg.DatabaseURL)
		if err != nil {
			return nil, "", err
		}
		pc.ConnConfig.RuntimeParams["search_path"] = schema
		pc.MaxConns = maxConns
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			return nil, "", err
		}
		d.defer_(pool.Close)
		return pool, schema, nil
	}

	d.orderPool, d.orderSchema, err = newPool("order", int32(d.cfg.Producers+4))
	if err != nil {
		return err
	}
	d.orders, err = order.New(order.Config{Pool: d.orderPool, Logger: d.logger})
	if err != nil {
		return err
	}
	if err := d.orders.Migrate(ctx); err != nil {
		return err
	}

	d.topo = shop.Topology{Prefix: "demo_" + d.id + ".", Prefetch: d.cfg.Prefetch}
	d.amqpConn, err = amqp091.Dial(d.cfg.AMQPURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ at %s unreachable: %w (start it, or set AMQP_URL)", d.cfg.AMQPURL, err)
	}
	d.defer_(func() { _ = d.amqpConn.Close() })
	ch, err := d.amqpConn.Channel()
	if err != nil {
		return err
	}
	if err := d.topo.Declare(ch, stock.Consumer, shipping.Consumer); err != nil {
		return err
	}
	_ = ch.Close()
	if !d.cfg.Keep {
		d.defer_(func() {
			if ch, err := d.amqpConn.Channel(); err == nil {
				_ = d.topo.Delete(ch, stock.Consumer, shipping.Consumer)
				_ = ch.Close()
			}
		})
	}

	d.shipHandler, err = shipping.NewHandler()
	if err != nil {
		return err
	}
	if d.stock, err = d.startConsumer(ctx, stock.Consumer, newPool, stock.Migrate, stock.Handle); err != nil {
		return err
	}
	if d.shipping, err = d.startConsumer(ctx, shipping.Consumer, newPool, shipping.Migrate, d.shipHandler.Handle); err != nil {
		return err
	}

	d.relayPub, err = wamqp.NewPublisher(d.topo.PublisherConfig(d.cfg.AMQPURL), d.logger)
	if err != nil {
		return fmt.Errorf("relay publisher: %w", err)
	}
	d.defer_(func() { _ = d.relayPub.Close() })
	d.reorder = &reorderingPublisher{
		Publisher:    d.relayPub,
		share:        d.cfg.Reorder,
		finalVersion: int64(1 + d.cfg.StatusChanges),
		rng:          d.rng,
		held:         map[string]heldStatus{},
	}
	d.flaky = &flakyOffsets{share: d.cfg.RelayFail, rng: d.rng}
	d.relay, err = order.NewRelay(order.RelayConfig{
		Pool:           d.orderPool,
		Publisher:      d.reorder,
		BatchSize:      d.cfg.BatchSize,
		PollInterval:   20 * time.Millisecond,
		RetryInterval:  20 * time.Millisecond,
		OffsetsAdapter: d.flaky,
		Logger:         d.logger,
	})
	if err != nil {
		return err
	}
	d.relayDone = make(chan error, 1)
	go func() { d.relayDone <- d.relay.Run(context.WithoutCancel(ctx)) }()
	d.defer_(func() { _ = d.relay.Close() })
	select {
	case <-d.relay.Running():
	case err := <-d.relayDone:
		return fmt.Errorf("relay: %w", err)
	case <-time.After(10 * time.Second):
		return errors.New("relay did not start within 10 s")
	}
	return nil
}

// startConsumer creates the consumer's schema, tables and fault proxy, and
// starts its service with the probe outermost.
func (d *demo) startConsumer(ctx context.Context, c shop.Consumer,
	newPool func(string, int32) (*pgxpool.Pool, string, error),
	migrate func(context.Context, *pgxpool.Pool, *processed.Store) error,
	handler message.NoPublishHandlerFunc,
) (*consumerRun, error) {
	pool, schema, err := newPool(c.Name, int32(d.cfg.Workers+2))
	if err != nil {
		return nil, err
	}
	if err := migrate(ctx, pool, nil); err != nil {
		return nil, err
	}
	uri, err := amqp091.ParseURI(d.cfg.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("AMQP_URL: %w", err)
	}
	proxy, err := faultproxy.Start(net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	if err != nil {
		return nil, err
	}
	d.defer_(func() { _ = proxy.Close() })
	uri.Host, uri.Port = "127.0.0.1", proxy.Port()
	r := &consumerRun{
		consumer: c,
		pool:     pool,
		schema:   schema,
		proxy:    proxy,
		rec:      &recorder{},
		probe: &consumerProbe{
			name:     c.Name,
			proxy:    proxy,
			cutEvery: int64(d.cfg.CutEvery),
			awaiting: map[string]bool{},
			perID:    map[string]int{},
		},
		done: make(chan error, 1),
	}
	mws := []message.HandlerMiddleware{r.probe.middleware}
	if d.cfg.IDAtReception {
		mws = append(mws, idAtReception)
	}
	r.svc, err = shop.NewService(shop.ServiceConfig{
		AMQPURL:       d.cfg.AMQPURL,
		SubscriberURL: uri.String(),
		Topology:      d.topo,
		Consumer:      c,
		Pool:          pool,
		Handler:       r.probe.handler(handler),
		Workers:       d.cfg.Workers,
		Middleware:    mws,
		Idempotent:    middleware.Config{Recorder: r.rec},
		Chain:         middleware.ChainConfig{InitialInterval: 20 * time.Millisecond, MaxInterval: time.Second},
		Logger:        d.logger,
	})
	if err != nil {
		return nil, err
	}
	d.defer_(func() { _ = r.svc.Close() })
	go func() { r.done <- r.svc.Run(context.WithoutCancel(ctx)) }()
	select {
	case <-r.svc.Running():
	case err := <-r.done:
		return nil, fmt.Errorf("%s service: %w", c.Name, err)
	case <-time.After(10 * time.Second):
		return nil, fmt.Errorf("%s service did not start within 10 s", c.Name)
	}
	return r, nil
}

// produce places the orders and their status changes from cfg.Producers
// goroutines, and publishes the malformed messages halfway through.
func (d *demo) produce(ctx context.Context) error {
	d.prodStart = time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, d.cfg.Producers+1)
	half := make(chan struct{})
	var halfOnce sync.Once
	for p := 0; p < d.cfg.Producers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			for i := p; i < d.cfg.Orders; i += d.cfg.Producers {
				if err := d.placeOne(ctx, i); err != nil {
					errs <- err
					return
				}
				if int(d.placed.Load()) >= d.cfg.Orders/2 {
					halfOnce.Do(func() { close(half) })
				}
			}
		}(p)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case <-half:
		case <-ctx.Done():
			return
		}
		if err := d.publishMalformed(ctx); err != nil {
			errs <- err
		}
	}()
	go func() { wg.Wait(); halfOnce.Do(func() { close(half) }); close(errs) }()
	for err := range errs {
		if err != nil {
			return err
		}
	}
	d.prodEnd = time.Now()
	return ctx.Err()
}

func (d *demo) placeOne(ctx context.Context, i int) error {
	id := fmt.Sprintf("o-%06d", i+1)
	n := 1 + d.rng.intN(d.cfg.MaxLines)
	lines := make([]shop.OrderLine, n)
	for l := range lines {
		lines[l] = shop.OrderLine{
			LineNo:   l + 1,
			SKU:      fmt.Sprintf("sku-%02d", d.rng.intN(25)),
			Quantity: fmt.Sprintf("%d.%03d", 1+d.rng.intN(4), d.rng.intN(1000)),
		}
	}
	if _, err := d.orders.PlaceOrder(ctx, id, lines); err != nil {
		return err
	}
	d.placed.Add(1)
	for _, st := range statuses[:d.cfg.StatusChanges] {
		if _, _, err := d.orders.ChangeStatus(ctx, id, st); err != nil {
			return err
		}
		d.changed.Add(1)
	}
	return nil
}

// publishMalformed publishes cfg.Malformed raw bodies to the events exchange
// with the routing key of placed orders, so each reaches both queues. Each
// has its own AMQP message id, "malformed-<n>", to find it in the
// dead-letter queues.
func (d *demo) publishMalformed(ctx context.Context) error {
	if d.cfg.Malformed == 0 {
		return nil
	}
	ch, err := d.amqpConn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	for i := 0; i < d.cfg.Malformed; i++ {
		id := fmt.Sprintf("malformed-%d", i+1)
		conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, d.topo.ExchangeName(), shop.EventOrderPlaced, false, false,
			amqp091.Publishing{MessageId: id, DeliveryMode: amqp091.Persistent, Body: malformedBodies[i%len(malformedBodies)]})
		if err != nil {
			return err
		}
		if ok, err := conf.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("malformed message %s not confirmed: %v", id, err)
		}
		d.malformedIDs = append(d.malformedIDs, id)
	}
	return nil
}

// replay waits until the relay has published everything once, releases any
// message the reorder fault still holds, then republishes the events of the
// first cfg.ReplayShare of the production time range, as an operator would.
func (d *demo) replay(ctx context.Context) error {
	deadline := d.started.Add(d.cfg.Timeout)
	for {
		n, err := d.orders.Pending(ctx, "")
		if err != nil {
			return err
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return nil // the check reports what is missing
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	if err := d.reorder.flush(); err != nil {
		return err
	}
	if d.cfg.ReplayShare == 0 {
		return nil
	}
	d.replayFrom = d.prodStart
	d.replayTo = d.prodStart.Add(time.Duration(float64(d.prodEnd.Sub(d.prodStart)) * d.cfg.ReplayShare))
	n, err := d.orders.Replay(ctx, d.relayPub, d.replayFrom, d.replayTo)
	d.replayed = n
	return err
}

// waitSettled polls until all work is done: outbox relayed, queues empty, no
// delivery in flight, every cut ack redelivered, every event processed by
// both consumers, and no delivery for a quiet period. It reports false when
// cfg.Timeout (from the start) passed first.
func (d *demo) waitSettled(ctx context.Context) bool {
	const quiet = 300 * time.Millisecond
	deadline := d.started.Add(d.cfg.Timeout)
	wantStock := int64(d.cfg.Orders)
	wantShipping := int64(d.cfg.Orders * (1 + d.cfg.StatusChanges))
	for time.Now().Before(deadline) {
		if sleep(ctx, 25*time.Millisecond) != nil {
			return false
		}
		pending, err := d.orders.Pending(ctx, "")
		if err != nil || pending > 0 || d.reorder.heldCount() > 0 {
			continue
		}
		if d.stock.probe.inFlight.Load() > 0 || d.shipping.probe.inFlight.Load() > 0 ||
			d.stock.probe.awaitingRedelivery() > 0 || d.shipping.probe.awaitingRedelivery() > 0 {
			continue
		}
		if d.stock.rec.processed.Load() < wantStock || d.shipping.rec.processed.Load()+d.shipping.rec.stale.Load() < wantShipping {
			continue
		}
		last := max(d.stock.probe.lastSeen.Load(), d.shipping.probe.lastSeen.Load())
		if time.Since(time.Unix(0, last)) < quiet {
			continue
		}
		ready, err := d.queued()
		if err == nil && ready == 0 {
			return true
		}
	}
	return false
}

// queued is the number of ready messages in both consumer queues.
func (d *demo) queued() (int, error) {
	ch, err := d.amqpConn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	total := 0
	for _, c := range []shop.Consumer{stock.Consumer, shipping.Consumer} {
		q, err := ch.QueueDeclarePassive(d.topo.Queue(c), true, false, false, false, nil)
		if err != nil {
			return 0, err
		}
		total += q.Messages
	}
	return total, nil
}

// shutdown stops the relay and the consumers gracefully.
func (d *demo) shutdown() error {
	return errors.Join(d.relay.Close(), d.stock.svc.Close(), d.shipping.svc.Close())
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func nowNanos() int64 { return time.Now().UnixNano() }

// startProgress prints a progress line on stderr every cfg.Progress: updated
// in place on a terminal, one line each time otherwise.
func (d *demo) startProgress() {
	if d.cfg.Progress <= 0 {
		return
	}
	if f, ok := d.stderr.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			d.progressTerminal = true
		}
	}
	d.progressStop = make(chan struct{})
	d.progressDone = make(chan struct{})
	go func() {
		defer close(d.progressDone)
		t := time.NewTicker(d.cfg.Progress)
		defer t.Stop()
		for {
			select {
			case <-d.progressStop:
				if d.progressTerminal {
					fmt.Fprintln(d.stderr)
				}
				return
			case <-t.C:
				d.printProgress()
			}
		}
	}()
}

func (d *demo) printProgress() {
	pending, _ := d.orders.Pending(context.Background(), "")
	line := fmt.Sprintf("%5.1fs  orders %d/%d  status changes %d/%d  outbox pending %d  deliveries %d  duplicates %d  stale %d  poisoned %d  cuts %d",
		time.Since(d.started).Seconds(),
		d.placed.Load(), d.cfg.Orders, d.changed.Load(), d.cfg.Orders*d.cfg.StatusChanges, pending,
		d.stock.probe.deliveries.Load()+d.shipping.probe.deliveries.Load(),
		d.stock.rec.duplicate.Load()+d.shipping.rec.duplicate.Load(),
		d.shipping.rec.stale.Load(),
		d.stock.rec.rejected.Load()+d.shipping.rec.rejected.Load(),
		d.stock.probe.cuts.Load()+d.shipping.probe.cuts.Load())
	if d.progressTerminal {
		fmt.Fprintf(d.stderr, "\r\033[K%s", line)
	} else {
		fmt.Fprintln(d.stderr, line)
	}
}

func (d *demo) stopProgress() {
	if d.progressStop == nil {
		return
	}
	select {
	case <-d.progressStop:
	default:
		close(d.progressStop)
	}
	<-d.progressDone
}
