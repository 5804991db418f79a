package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/billing"
	"github.com/watermill-idempotency/idempotency/examples/indexer"
	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shipping"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
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

// recorder counts the outcomes of one consumer (ConsumerConfig.Recorder).
type recorder struct {
	processed, duplicate, stale, obsolete, failed, rejected atomic.Int64
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
	case middleware.OutcomeObsolete:
		r.obsolete.Add(1)
	case middleware.OutcomeFailed:
		r.failed.Add(1)
	default:
		r.rejected.Add(1)
	}
}

// consumerRun is one consumer service of the run.
type consumerRun struct {
	consumer shop.Consumer
	db       shop.DB
	schema   string
	probe    *consumerProbe
	rec      *recorder
	svc      *shop.Service
	done     chan error
}

// consumerSpec is what startConsumer needs to know of a consumer service
// beyond the demo's common settings.
type consumerSpec struct {
	consumer shop.Consumer
	db       shop.DB // the service's database
	schema   string  // db's schema (embedded: its name in the checks)
	// Exactly one of handler and publish (with publishTopic).
	handler      message.NoPublishHandlerFunc
	publish      message.HandlerFunc
	publishTopic string
	outbox       *outbox.Outbox   // the service's outbox and relay, optional
	table        processed.Config // the processed-event table; zero: the default
	// relayDest wraps the relay's destination (fault injection), optional.
	relayDest func(message.Publisher) message.Publisher
	// recorder wraps the run's recorder (the indexer counts its skips),
	// optional.
	recorder func(middleware.Recorder) middleware.Recorder
}

// billingRun is the billing service's state beside its two consumers.
type billingRun struct {
	svc      *billing.Service
	provider *billing.Provider
	mailer   *billing.Mailer
	outbox   *outbox.Outbox
	flaky    *flakyConfirms
	charge   *consumerRun // billing.Consumer: orders → charges + confirmations
	mail     *consumerRun // billing.MailerConsumer: confirmations → e-mails
}

// catalogueRun is the catalogue (producer) and the indexer (consumer).
type catalogueRun struct {
	cat       *indexer.Catalogue
	db        shop.DB
	schema    string
	flaky     *flakyConfirms
	reorder   *reorderingPublisher
	relay     *outbox.Relay
	relayDone chan error
	ix        *indexer.Indexer
	index     *indexer.SearchIndex
	indexer   *consumerRun
	imported  atomic.Int64
	replayed  int
}

type demo struct {
	cfg    config
	stdout io.Writer
	stderr io.Writer
	logger watermill.LoggerAdapter
	rng    *lockedRand

	id          string
	admin       *pgxpool.Pool // services backend
	dir         string        // embedded backend: the SQLite files
	attached    []attachment  // embedded backend: the files the checks attach
	broker      broker        // RabbitMQ, NATS JetStream, Kafka or the in-process broker
	orderSchema string
	orderDB     shop.DB
	orders      *order.Service
	stock       *consumerRun
	shipping    *consumerRun
	shipHandler *shipping.Handler
	billing     *billingRun
	catalogue   *catalogueRun

	relay     *order.Relay
	relayDone chan error
	reorder   *reorderingPublisher
	flaky     *flakyConfirms

	placed, changed  atomic.Int64
	malformedIDs     []string
	malformedKeys    []string // routing keys each malformed message was published with
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

// consumers are the run's consumer services.
func (d *demo) consumers() []*consumerRun {
	var out []*consumerRun
	for _, c := range []*consumerRun{d.stock, d.shipping, d.billing.charge, d.billing.mail, d.catalogue.indexer} {
		if c != nil {
			out = append(out, c)
		}
	}
	return out
}

// run executes one demo run and prints its report; it returns the exit
// status (0 ok, 1 not ok, 2 could not run).
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	d := &demo{cfg: cfg, stdout: stdout, stderr: stderr, rng: newLockedRand(cfg.Seed), started: time.Now(),
		billing: &billingRun{}, catalogue: &catalogueRun{}}
	d.logger = watermill.NopLogger{}
	if cfg.Verbose {
		d.logger = watermill.NewStdLoggerWithOut(stderr, false, false)
	}
	defer d.cleanup()
	fmt.Fprintln(stdout, "demo:", backendLine(cfg))
	res, err := d.run(ctx)
	d.stopProgress()
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err, "("+backendLine(cfg)+")")
		return 2
	}
	res.Backend = cfg.Backend
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
// relays, and starts them.
func (d *demo) setup(ctx context.Context) error {
	d.id = randomID()
	all := []shop.Consumer{stock.Consumer, shipping.Consumer, billing.Consumer, billing.MailerConsumer, indexer.Consumer}
	var err error
	if d.embedded() {
		if d.dir, err = os.MkdirTemp("", "watermill-idempotency-demo-"); err != nil {
			return err
		}
		if d.cfg.Keep {
			fmt.Fprintln(d.stderr, "demo: SQLite files kept in", d.dir)
		} else {
			d.defer_(func() { _ = os.RemoveAll(d.dir) }) // first in, last out: after the files are closed
		}
		if d.broker, err = d.newChannelBroker(all); err != nil {
			return err
		}
	} else {
		d.admin, err = pgxpool.New(ctx, d.cfg.DatabaseURL)
		if err != nil {
			return fmt.Errorf("PostgreSQL %s: %w", d.cfg.DatabaseURL, err)
		}
		d.defer_(d.admin.Close)
		if err := d.admin.Ping(ctx); err != nil {
			return fmt.Errorf("PostgreSQL at %s unreachable: %w (start it, or set DATABASE_URL)", d.cfg.DatabaseURL, err)
		}
		switch d.cfg.Backend {
		case backendJetStream:
			d.broker, err = d.newJetStreamBroker(all)
		case backendKafka:
			d.broker, err = d.newKafkaBroker(all)
			// The run's clock (-timeout) starts once the broker is up: the
			// first build of the Kafka peer takes a while.
			d.started = time.Now()
		default:
			d.broker, err = d.newAMQPBroker(all)
		}
		if err != nil {
			return err
		}
		if d.cfg.OpenTx {
			if err := d.holdOpenTransaction(ctx); err != nil {
				return err
			}
		}
	}

	d.orderDB, d.orderSchema, err = d.newDB(ctx, "order", int32(d.cfg.Producers+4))
	if err != nil {
		return err
	}
	d.orders, err = order.New(order.Config{Pool: d.orderDB.Pool, DB: d.orderDB.SQL, Logger: d.logger})
	if err != nil {
		return err
	}
	if err := d.orders.Migrate(ctx); err != nil {
		return err
	}

	d.shipHandler, err = shipping.NewHandlerFor(d.orderDB.Dialect)
	if err != nil {
		return err
	}
	for _, c := range []struct {
		dst     **consumerRun
		c       shop.Consumer
		migrate func(context.Context, shop.DB, processed.Config) error
		handler message.NoPublishHandlerFunc
	}{
		{&d.stock, stock.Consumer, stock.MigrateDB, stock.HandlerFor(d.orderDB.Dialect)},
		{&d.shipping, shipping.Consumer, shipping.MigrateDB, d.shipHandler.Handle},
	} {
		db, schema, err := d.newDB(ctx, c.c.Name, int32(d.cfg.Workers+2))
		if err != nil {
			return err
		}
		table := d.processedTable(schema)
		if err := c.migrate(ctx, db, table); err != nil {
			return err
		}
		if err := d.maintainPartitions(ctx, db, table); err != nil {
			return err
		}
		if *c.dst, err = d.startConsumer(ctx, consumerSpec{consumer: c.c, db: db, schema: schema, handler: c.handler, table: table}); err != nil {
			return err
		}
	}
	if err := d.setupBilling(ctx); err != nil {
		return err
	}
	if err := d.setupCatalogue(ctx); err != nil {
		return err
	}

	d.reorder = &reorderingPublisher{
		Publisher:    d.broker.publisher(),
		topic:        shop.EventOrderStatusChanged,
		version:      statusVersion,
		share:        d.cfg.Reorder,
		finalVersion: int64(1 + d.cfg.StatusChanges),
		rng:          d.rng,
		held:         map[string]heldMessage{},
	}
	d.flaky = d.newFlakyConfirms(d.reorder)
	d.relay, err = order.NewRelay(order.RelayConfig{
		Pool:          d.orderDB.Pool,
		DB:            d.orderDB.SQL,
		Publisher:     d.flaky,
		BatchSize:     d.cfg.BatchSize,
		PollInterval:  relayConfig.PollInterval,
		RetryInterval: relayConfig.RetryInterval,
		MaxBackoff:    relayConfig.MaxBackoff,
		MaxAttempts:   relayConfig.MaxAttempts,
		Logger:        d.logger,
	})
	if err != nil {
		return err
	}
	d.relayDone = make(chan error, 1)
	go func() { d.relayDone <- d.relay.Run(context.WithoutCancel(ctx)) }()
	d.defer_(func() { _ = d.relay.Close() })
	return waitRunning("order relay", d.relay.Running(), d.relayDone)
}

// setupBilling wires the billing example as users should: the operation
// runner on a small pool of its own (same database and schema), the
// provider with timeouts injected after charging, two consumer services on
// the billing schema. The charging service is a publishing handler whose
// confirmation requests go through its transactional outbox, relayed by the
// service (with a relay that republishes, as the others); its consumer has a
// reconciliation queue, where operation.RouteUncertain (in the chain's
// AfterPoison) sends charges that stay uncertain.
func (d *demo) setupBilling(ctx context.Context) error {
	b := d.billing
	db, schema, err := d.newDB(ctx, billing.Consumer.Name, int32(2*d.cfg.Workers+4))
	if err != nil {
		return err
	}
	var runner *operation.Runner
	if d.embedded() {
		// SQLite has one writer per file: the runner's records go to a file
		// of their own, since the handler's transaction holds the service
		// file's write lock while the runner records the charge.
		opsDB, err := d.sqliteFile("billing_operations", d.cfg.Workers+2)
		if err != nil {
			return err
		}
		if runner, err = operation.NewRunner(operation.Config{DB: idempotency.SQL(opsDB, idempotency.SQLite)}, d.logger); err != nil {
			return err
		}
		if err := runner.Migrate(ctx); err != nil {
			return err
		}
		if err := billing.MigrateDB(ctx, db, processed.Config{}, nil); err != nil {
			return err
		}
	} else {
		runnerPool, err := d.poolOn(ctx, schema, int32(d.cfg.Workers+2))
		if err != nil {
			return err
		}
		if runner, err = operation.NewRunner(operation.Config{DB: idempotency.Pgx(runnerPool)}, d.logger); err != nil {
			return err
		}
		if err := billing.MigrateDB(ctx, db, processed.Config{}, runner); err != nil {
			return err
		}
	}
	b.outbox, err = db.Outbox("billing_outbox", d.logger)
	if err != nil {
		return err
	}
	if err := b.outbox.Migrate(ctx); err != nil {
		return err
	}
	b.provider = billing.NewProvider()
	b.provider.InjectTimeouts(d.cfg.ProviderTimeoutEvery)
	b.mailer = billing.NewMailer()
	b.svc, err = billing.New(billing.Config{Runner: runner, Provider: b.provider, Mailer: b.mailer, Dialect: db.Dialect, Logger: d.logger})
	if err != nil {
		return err
	}
	b.charge, err = d.startConsumer(ctx, consumerSpec{
		consumer: billing.Consumer, db: db, schema: schema,
		publish: b.svc.HandleOrderPlaced, publishTopic: billing.EventConfirmationRequested, outbox: b.outbox,
		relayDest: func(p message.Publisher) message.Publisher { b.flaky = d.newFlakyConfirms(p); return b.flaky },
	})
	if err != nil {
		return err
	}
	b.mail, err = d.startConsumer(ctx, consumerSpec{consumer: billing.MailerConsumer, db: db, schema: schema, handler: b.svc.HandleConfirmation})
	return err
}

// setupCatalogue wires the indexer example as users should: the catalogue
// on its own schema and pool, migrated before the indexer (whose filter
// reads the catalogue's latest table by its qualified name), the indexer
// as a consumer service on a schema of its own, and the catalogue's relay
// (through a reordering publisher, and republishing like the others).
func (d *demo) setupCatalogue(ctx context.Context) error {
	c := d.catalogue
	var err error
	c.db, c.schema, err = d.newDB(ctx, "catalogue", int32(d.cfg.Producers+4))
	if err != nil {
		return err
	}
	c.cat, err = indexer.NewCatalogue(indexer.CatalogueConfig{Pool: c.db.Pool, DB: c.db.SQL, Logger: d.logger})
	if err != nil {
		return err
	}
	if err := c.cat.Migrate(ctx); err != nil {
		return err
	}
	latency := d.cfg.IndexLatency
	if latency == 0 {
		latency = -1 // NewSearchIndex: none
	}
	c.index = indexer.NewSearchIndex(latency)
	ixCfg := indexer.IndexerConfig{
		Index:       c.index,
		LatestTable: c.schema + "." + versioned.DefaultLatestTable,
		Logger:      d.logger,
	}
	if d.embedded() {
		// The catalogue's latest table is in its own file: the filter reads
		// it there, outside the indexer's transaction.
		ixCfg.LatestTable, ixCfg.LatestDB, ixCfg.Dialect = "", c.db.Handle(), idempotency.SQLite
	}
	c.ix, err = indexer.NewIndexer(ixCfg)
	if err != nil {
		return err
	}
	ixDB, ixSchema, err := d.newDB(ctx, indexer.Consumer.Name, int32(d.cfg.Workers+2))
	if err != nil {
		return err
	}
	if err := c.ix.MigrateDB(ctx, ixDB, processed.Config{}); err != nil {
		return err
	}
	c.indexer, err = d.startConsumer(ctx, consumerSpec{consumer: indexer.Consumer, db: ixDB, schema: ixSchema, handler: c.ix.Handle, recorder: c.ix.Recorder})
	if err != nil {
		return err
	}
	c.reorder = &reorderingPublisher{
		Publisher:    d.broker.publisher(),
		topic:        indexer.EventProductUpdated,
		version:      productVersion,
		share:        d.cfg.Reorder,
		finalVersion: int64(d.cfg.Updates),
		rng:          d.rng,
		held:         map[string]heldMessage{},
	}
	c.flaky = d.newFlakyConfirms(c.reorder)
	c.relay, err = c.cat.NewRelay(c.flaky, relayConfig)
	if err != nil {
		return err
	}
	c.relayDone = make(chan error, 1)
	go func() { c.relayDone <- c.relay.Run(context.WithoutCancel(ctx)) }()
	d.defer_(func() { _ = c.relay.Close() })
	return waitRunning("catalogue relay", c.relay.Running(), c.relayDone)
}

// waitRunning waits for running, or for done to report that it stopped.
func waitRunning(what string, running <-chan struct{}, done <-chan error) error {
	select {
	case <-running:
		return nil
	case err := <-done:
		return fmt.Errorf("%s: %w", what, err)
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s did not start within 10 s", what)
	}
}

// startConsumer creates the consumer's fault proxy and starts its service
// with the probe outermost.
func (d *demo) startConsumer(ctx context.Context, s consumerSpec) (*consumerRun, error) {
	c := s.consumer
	transport, cut, err := d.broker.transport(c)
	if err != nil {
		return nil, err
	}
	r := &consumerRun{
		consumer: c,
		db:       s.db,
		schema:   s.schema,
		rec:      &recorder{},
		probe: &consumerProbe{
			name:     c.Name,
			cut:      cut,
			cutEvery: int64(d.cfg.CutEvery),
			// JetStream redelivers an unacked message after AckWait
			// (shop.DefaultJetStreamAckWait) on a live connection too.
			ackWaitRedelivers: d.cfg.Backend == backendJetStream,
			awaiting:          map[string]bool{},
			perID:             map[string][]malformedDelivery{},
		},
		done: make(chan error, 1),
	}
	mws := []message.HandlerMiddleware{r.probe.middleware}
	if d.cfg.IDAtReception {
		mws = append(mws, idAtReception)
	}
	var rec middleware.Recorder = r.rec
	if s.recorder != nil {
		rec = s.recorder(rec)
	}
	cfg := shop.ServiceConfig{
		Transport:  transport,
		Consumer:   c,
		Pool:       s.db.Pool,
		DB:         s.db.SQL,
		Outbox:     s.outbox,
		Relay:      relayConfig,
		RelayDest:  s.relayDest,
		Workers:    d.cfg.Workers,
		Middleware: mws,
		Idempotency: middleware.ConsumerConfig{
			Table: s.table.Table, Layout: s.table.Layout, ReplayHorizon: replayHorizon(s.table),
			Recorder: rec,
			Retry:    middleware.RetryConfig{InitialInterval: 20 * time.Millisecond, MaxInterval: time.Second},
		},
		Logger: d.logger,
	}
	if s.publish != nil {
		cfg.PublishHandler, cfg.PublishTopic = r.probe.handler(s.publish), s.publishTopic
	} else {
		h := r.probe.handler(func(msg *message.Message) ([]*message.Message, error) { return nil, s.handler(msg) })
		cfg.Handler = func(msg *message.Message) error { _, err := h(msg); return err }
	}
	r.svc, err = shop.NewService(cfg)
	if err != nil {
		return nil, err
	}
	d.defer_(func() { _ = r.svc.Close() })
	go func() { r.done <- r.svc.Run(context.WithoutCancel(ctx)) }()
	if err := waitRunning(c.Name+" service", r.svc.Running(), r.done); err != nil {
		return nil, err
	}
	return r, nil
}

// produce places the orders and their status changes from cfg.Producers
// goroutines, imports the catalogue at the same time, and publishes the
// malformed messages halfway through.
func (d *demo) produce(ctx context.Context) error {
	d.prodStart = time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, d.cfg.Producers+2)
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
		n, err := d.catalogue.cat.Import(ctx, indexer.ImportConfig{
			Products: d.cfg.Products, UpdatesPerProduct: d.cfg.Updates, Workers: d.cfg.Producers,
		})
		d.catalogue.imported.Store(int64(n))
		if err != nil {
			errs <- err
		}
	}()
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
// with the first routing key of each consumer, so each reaches every
// consumer queue once. Each has its own AMQP message id, "malformed-<n>", to
// find it in the dead-letter queues.
func (d *demo) publishMalformed(ctx context.Context) error {
	if d.cfg.Malformed == 0 {
		return nil
	}
	seen := map[string]bool{}
	for _, c := range d.consumers() {
		if k := c.consumer.Bindings[0]; !seen[k] {
			seen[k] = true
			d.malformedKeys = append(d.malformedKeys, k)
		}
	}
	for i := 0; i < d.cfg.Malformed; i++ {
		id := fmt.Sprintf("malformed-%d", i+1)
		for _, key := range d.malformedKeys {
			if err := d.broker.publishRaw(ctx, key, id, malformedBodies[i%len(malformedBodies)]); err != nil {
				return err
			}
		}
		d.malformedIDs = append(d.malformedIDs, id)
	}
	return nil
}

// malformedPerQueue is how many copies of each malformed message c's queue
// receives: one per routing key it was published with that c binds.
func (d *demo) malformedPerQueue(c shop.Consumer) int {
	n := 0
	for _, k := range d.malformedKeys {
		if slices.Contains(c.Bindings, k) {
			n++
		}
	}
	return n
}

// pending is the outbox rows not yet relayed, per outbox.
type pending struct{ order, catalogue, billing int }

func (p pending) total() int { return p.order + p.catalogue + p.billing }

func (d *demo) pending(ctx context.Context) (pending, error) {
	var p pending
	var err error
	if p.order, err = d.orders.Pending(ctx); err != nil {
		return p, err
	}
	if p.catalogue, err = shop.OutboxPending(ctx, d.catalogue.db, d.catalogue.cat.Outbox()); err != nil {
		return p, err
	}
	p.billing, err = shop.OutboxPending(ctx, d.billing.charge.db, d.billing.outbox)
	return p, err
}

// replay waits until the order and catalogue relays have published
// everything once, releases any message the reorder faults still hold, then
// republishes the events of the first cfg.ReplayShare of the production
// time range from both outboxes, as an operator would.
func (d *demo) replay(ctx context.Context) error {
	deadline := d.started.Add(d.cfg.Timeout)
	for {
		// A failed poll (the server out of connections for a moment,
		// 53300) is polled again, as waitSettled does; it ends the run
		// only when it is still failing at the deadline.
		p, err := d.pending(ctx)
		if err == nil && p.order == 0 && p.catalogue == 0 {
			break
		}
		if time.Now().After(deadline) {
			return err // nil: the check reports what is missing
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	if err := errors.Join(d.reorder.flush(), d.catalogue.reorder.flush()); err != nil {
		return err
	}
	if d.cfg.ReplayShare == 0 {
		return nil
	}
	d.replayFrom = d.prodStart
	d.replayTo = d.prodStart.Add(time.Duration(float64(d.prodEnd.Sub(d.prodStart)) * d.cfg.ReplayShare))
	if !d.replayFrom.Before(d.replayTo) {
		return nil
	}
	var err error
	if d.replayed, err = d.orders.Replay(ctx, d.broker.publisher(), d.replayFrom, d.replayTo); err != nil {
		return err
	}
	d.catalogue.replayed, err = d.catalogue.cat.Replay(ctx, d.broker.publisher(), d.replayFrom, d.replayTo)
	return err
}

// waitSettled polls until all work is done: outboxes relayed, queues empty,
// no delivery in flight, every cut ack redelivered, every event processed
// by its consumers, every charge confirmed, the index at the catalogue's
// latest versions, and no delivery for a quiet period. It reports false
// when cfg.Timeout (from the start) passed first.
func (d *demo) waitSettled(ctx context.Context) bool {
	const quiet = 300 * time.Millisecond
	deadline := d.started.Add(d.cfg.Timeout)
	orders := int64(d.cfg.Orders)
	wantShipping := int64(d.cfg.Orders * (1 + d.cfg.StatusChanges))
	wantUpdates := int64(d.cfg.Products * d.cfg.Updates)
	c := d.catalogue
	for time.Now().Before(deadline) {
		if sleep(ctx, 25*time.Millisecond) != nil {
			return false
		}
		p, err := d.pending(ctx)
		if err != nil || p.total() > 0 || d.reorder.heldCount() > 0 || c.reorder.heldCount() > 0 {
			continue
		}
		busy := false
		var last int64
		for _, r := range d.consumers() {
			busy = busy || r.probe.inFlight.Load() > 0 || r.probe.awaitingRedelivery() > 0
			last = max(last, r.probe.lastSeen.Load())
		}
		if busy {
			continue
		}
		if d.stock.rec.processed.Load() < orders ||
			d.shipping.rec.processed.Load()+d.shipping.rec.stale.Load() < wantShipping ||
			d.billing.charge.rec.processed.Load() < orders || d.billing.mail.rec.processed.Load() < orders ||
			c.indexer.rec.processed.Load()+c.indexer.rec.obsolete.Load()+c.indexer.rec.stale.Load() < wantUpdates {
			continue
		}
		// With -id-at-reception the latest filter compares fresh ids, not
		// the producer's: the index may never reach the latest versions,
		// and the check reports it rather than the run waiting out
		// -timeout for it.
		if want, err := c.cat.Versions(ctx); err != nil || (indexer.CheckLatest(c.index, want) != nil && !d.cfg.IDAtReception) {
			continue
		}
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

// queued is the number of ready messages in the consumer queues.
func (d *demo) queued() (int, error) {
	total := 0
	for _, c := range d.consumers() {
		n, err := d.broker.queued(c.consumer)
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// shutdown stops the relays and the consumers gracefully.
func (d *demo) shutdown() error {
	errs := []error{d.relay.Close(), d.catalogue.relay.Close()}
	for _, c := range d.consumers() {
		errs = append(errs, c.svc.Close())
	}
	return errors.Join(errs...)
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
	p, _ := d.pending(context.Background())
	var deliveries, duplicates, stale, poisoned, cuts int64
	for _, c := range d.consumers() {
		deliveries += c.probe.deliveries.Load()
		duplicates += c.rec.duplicate.Load()
		stale += c.rec.stale.Load() + c.rec.obsolete.Load()
		poisoned += c.rec.rejected.Load()
		cuts += c.probe.cuts.Load()
	}
	line := fmt.Sprintf("%5.1fs  orders %d/%d  status changes %d/%d  product updates %d/%d  outbox pending %d  deliveries %d  duplicates %d  stale/obsolete %d  poisoned %d  cuts %d  charges %d  mails %d  indexed %d",
		time.Since(d.started).Seconds(),
		d.placed.Load(), d.cfg.Orders, d.changed.Load(), d.cfg.Orders*d.cfg.StatusChanges,
		d.catalogue.indexer.rec.processed.Load()+d.catalogue.indexer.rec.obsolete.Load()+d.catalogue.indexer.rec.stale.Load(), d.cfg.Products*d.cfg.Updates,
		p.total(), deliveries, duplicates, stale, poisoned, cuts,
		d.billing.provider.Charges(), d.billing.mailer.Count(), d.catalogue.ix.Stats().IndexUpdates)
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
