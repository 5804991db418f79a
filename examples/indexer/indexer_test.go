package indexer_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/examples/indexer"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

// ixRedis returns a client on the test Redis (REDIS_URL: redis://… or
// host:port; default 127.0.0.1:6379) and a key prefix of the test's own,
// deleted when the test ends. The test fails when Redis is unreachable.
func ixRedis(t *testing.T) (*redis.Client, string) {
	t.Helper()
	opt := &redis.Options{Addr: "127.0.0.1:6379"}
	if u := os.Getenv("REDIS_URL"); strings.Contains(u, "://") {
		var err error
		opt, err = redis.ParseURL(u)
		require.NoError(t, err)
	} else if u != "" {
		opt.Addr = u
	}
	client := redis.NewClient(opt)
	ctx := context.Background()
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		t.Fatalf("Redis at %s unreachable: %v", opt.Addr, err)
	}
	prefix := testenv.UniqueName("t") + ":"
	t.Cleanup(func() {
		iter := client.Scan(ctx, 0, prefix+"*", 500).Iterator()
		for iter.Next(ctx) {
			_ = client.Del(ctx, iter.Val()).Err()
		}
		_ = client.Close()
	})
	return client, prefix
}

// attempts counts the idempotent middleware's finished attempts (commit
// included) by outcome.
type attempts struct {
	mu sync.Mutex
	by map[middleware.Outcome]int
}

func newAttempts() *attempts { return &attempts{by: map[middleware.Outcome]int{}} }

func (a *attempts) RecordOutcome(o middleware.Observation) {
	a.mu.Lock()
	a.by[o.Outcome]++
	a.mu.Unlock()
}

func (a *attempts) get(o middleware.Outcome) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.by[o]
}

// completed is the number of events whose claim committed: indexed or
// skipped as obsolete or stale.
func (a *attempts) completed() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.by[middleware.OutcomeProcessed] + a.by[middleware.OutcomeObsolete] + a.by[middleware.OutcomeStale]
}

// wait waits until n events completed and at least duplicates deliveries
// were skipped as duplicates. A failed attempt (retried: under load, a
// claim can wait out its lock timeout) and a redelivery by the broker are
// not completions, so they cannot end the wait early.
func (a *attempts) wait(t *testing.T, n, duplicates int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for a.completed() < n || a.get(middleware.OutcomeDuplicate) < duplicates {
		if time.Now().After(deadline) {
			a.mu.Lock()
			defer a.mu.Unlock()
			t.Fatalf("after 2 minutes, %d of %d events completed, %d of %d duplicates skipped (outcomes: %v)",
				a.by[middleware.OutcomeProcessed]+a.by[middleware.OutcomeObsolete]+a.by[middleware.OutcomeStale], n,
				a.by[middleware.OutcomeDuplicate], duplicates, a.by)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// shopDB is the demo's layout: the catalogue and the indexer in two schemas
// of one database; the indexer reads the catalogue's latest table by its
// qualified name.
type shopDB struct {
	catalogue *indexer.Catalogue
	catPool   *pgxpool.Pool
	ixPool    *pgxpool.Pool
	ixSchema  string
	latestTbl string
}

func newShopDB(t *testing.T, latest versioned.LatestStore) *shopDB {
	t.Helper()
	ctx := context.Background()
	catSchema, ixSchema := testenv.Schema(t), testenv.Schema(t)
	db := &shopDB{catPool: testenv.PoolOn(t, catSchema, 6), ixPool: testenv.PoolOn(t, ixSchema, 8), ixSchema: ixSchema,
		latestTbl: catSchema + "." + versioned.DefaultLatestTable}
	var err error
	db.catalogue, err = indexer.NewCatalogue(indexer.CatalogueConfig{Pool: db.catPool, Latest: latest})
	require.NoError(t, err)
	require.NoError(t, db.catalogue.Migrate(ctx))
	return db
}

// startRelay relays the catalogue's outbox to dest until the test ends.
func startRelay(t *testing.T, c *indexer.Catalogue, dest message.Publisher) {
	t.Helper()
	relay, err := c.NewRelay(dest, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Retention: time.Hour})
	require.NoError(t, err)
	runInBackground(t, relay.Run, relay.Running(), relay.Close)
}

// runInBackground runs run until the test ends (then close), after running
// is closed.
func runInBackground(t *testing.T, run func(context.Context) error, running chan struct{}, closeFn func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- run(context.Background()) }()
	t.Cleanup(func() {
		_ = closeFn()
		<-done
	})
	select {
	case <-running:
	case err := <-done:
		t.Fatalf("did not start: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("did not start within 30 s")
	}
}

// startIndexer runs the indexer through its consumer's whole chain on an
// in-memory broker, with workers subscriptions (each receives its own copy
// of every message from the GoChannel: duplicates).
func startIndexer(t *testing.T, db *shopDB, ix *indexer.Indexer, broker *gochannel.GoChannel, rec middleware.Recorder, workers int) {
	t.Helper()
	require.NoError(t, ix.Migrate(context.Background(), db.ixPool, processed.Config{}))
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: indexer.Consumer.Name,
		DB:       idempotency.Pgx(db.ixPool),
		Recorder: ix.Recorder(rec),
		Poison:   middleware.PoisonConfig{Publisher: broker, Topic: "poison"},
		Retry:    middleware.RetryConfig{InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
	}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	_, err = c.AddConsumerHandler(router, indexer.Consumer.Name, indexer.EventProductUpdated, shop.Subscriptions(broker, workers), ix.Handle)
	require.NoError(t, err)
	runInBackground(t, router.Run, router.Running(), router.Close)
}

// The import updates each product 40 times before the indexer starts: the
// slow index receives one document per product, the latest, and every other
// update is acked as obsolete.
func TestIndexerProcessesOnlyTheLatest(t *testing.T) {
	t.Parallel()
	const products, updates = 4, 40
	ctx := context.Background()
	db := newShopDB(t, nil)
	n, err := db.catalogue.Import(ctx, indexer.ImportConfig{Products: products, UpdatesPerProduct: updates, Workers: 2})
	require.NoError(t, err)
	require.Equal(t, products*updates, n)

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 256}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	index := indexer.NewSearchIndex(5 * time.Millisecond)
	ix, err := indexer.NewIndexer(indexer.IndexerConfig{Index: index, LatestTable: db.latestTbl})
	require.NoError(t, err)
	rec := newAttempts()
	startIndexer(t, db, ix, broker, rec, 1)
	startRelay(t, db.catalogue, broker)
	rec.wait(t, n, 0)

	want, err := db.catalogue.Versions(ctx)
	require.NoError(t, err)
	require.Len(t, want, products)
	require.NoError(t, indexer.CheckLatest(index, want))
	stats := ix.Stats()
	require.Equal(t, indexer.Stats{IndexUpdates: products, ObsoleteSkipped: int64(n - products)}, stats)
	require.EqualValues(t, products, index.Puts())
	require.Equal(t, products, rec.get(middleware.OutcomeProcessed))
	require.Equal(t, n-products, rec.get(middleware.OutcomeObsolete), "skips recorded like duplicates")
}

// Import and indexing at the same time, latest records in Redis, and three
// router handlers on the in-memory broker, each of which receives every
// message (so every update is delivered three times at once): the index
// ends with every product's latest version, each update passes the claim
// once and is then indexed or skipped.
func TestIndexerConcurrentImportRedis(t *testing.T) {
	t.Parallel()
	const products, updates = 6, 25
	ctx := context.Background()
	client, prefix := ixRedis(t)
	latest, err := redislatest.New(redislatest.Config{Client: client, Prefix: prefix})
	require.NoError(t, err)
	db := newShopDB(t, latest)

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 256}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	index := indexer.NewSearchIndex(10 * time.Millisecond)
	ix, err := indexer.NewIndexer(indexer.IndexerConfig{Index: index, LatestTable: db.latestTbl, Latest: latest})
	require.NoError(t, err)
	rec := newAttempts()
	startIndexer(t, db, ix, broker, rec, 3)
	startRelay(t, db.catalogue, broker)

	n, err := db.catalogue.Import(ctx, indexer.ImportConfig{Products: products, UpdatesPerProduct: updates, Workers: 3})
	require.NoError(t, err)
	rec.wait(t, n, 2*n)

	want, err := db.catalogue.Versions(ctx)
	require.NoError(t, err)
	require.NoError(t, indexer.CheckLatest(index, want))
	stats := ix.Stats()
	require.EqualValues(t, n, stats.IndexUpdates+stats.ObsoleteSkipped+stats.StaleSkipped)
	require.GreaterOrEqual(t, stats.IndexUpdates, int64(products))
	require.Equal(t, 2*n, rec.get(middleware.OutcomeDuplicate))
	// Each update completed once and was skipped exactly twice; a failed
	// attempt in between (a connection a saturated server refused, 53300)
	// was retried and is neither, so it is not asserted away.
	require.Equal(t, n, rec.completed())
}

// The demo's wiring: the catalogue's relay publishes to RabbitMQ
// (shop.Topology), the indexer is a shop.Service whose Handler is
// Indexer.Handle (inside the idempotent middleware). The family metadata
// travels as AMQP headers.
func TestIndexerOverRabbitMQ(t *testing.T) {
	t.Parallel()
	const products, updates = 3, 30
	ctx := context.Background()
	db := newShopDB(t, nil)
	n, err := db.catalogue.Import(ctx, indexer.ImportConfig{Products: products, UpdatesPerProduct: updates})
	require.NoError(t, err)

	topo := shop.Topology{Prefix: testenv.UniqueName("t") + "."}
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s", testenv.AMQPURL())
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, topo.Declare(ch, indexer.Consumer))
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = topo.Delete(ch, indexer.Consumer)
			_ = ch.Close()
		}
	})

	index := indexer.NewSearchIndex(5 * time.Millisecond)
	ix, err := indexer.NewIndexer(indexer.IndexerConfig{Index: index, LatestTable: db.latestTbl})
	require.NoError(t, err)
	require.NoError(t, ix.Migrate(ctx, db.ixPool, processed.Config{}))
	rec := newAttempts()
	svc, err := shop.NewService(shop.ServiceConfig{
		AMQPURL:     testenv.AMQPURL(),
		Topology:    topo,
		Consumer:    indexer.Consumer,
		Pool:        db.ixPool,
		Handler:     ix.Handle,
		Workers:     2,
		Idempotency: middleware.ConsumerConfig{Recorder: ix.Recorder(rec)},
	})
	require.NoError(t, err)
	runInBackground(t, svc.Run, svc.Running(), svc.Close)

	pub, err := wamqp.NewPublisher(topo.PublisherConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	startRelay(t, db.catalogue, pub)
	rec.wait(t, n, 0)

	want, err := db.catalogue.Versions(ctx)
	require.NoError(t, err)
	require.NoError(t, indexer.CheckLatest(index, want))
	require.Equal(t, indexer.Stats{IndexUpdates: products, ObsoleteSkipped: int64(n - products)}, ix.Stats())
}

func TestCheckLatest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	index := indexer.NewSearchIndex(-1)
	require.NoError(t, indexer.CheckLatest(index, map[string]int64{}))
	require.NoError(t, index.Put(ctx, indexer.Document{SKU: "p-1", Version: 2}))
	require.NoError(t, indexer.CheckLatest(index, map[string]int64{"p-1": 2}))
	require.ErrorIs(t, indexer.CheckLatest(index, map[string]int64{"p-1": 3}), indexer.ErrIndexBehind)
	require.ErrorContains(t, indexer.CheckLatest(index, map[string]int64{"p-1": 2, "p-2": 1}), "p-2: missing")
	require.ErrorContains(t, indexer.CheckLatest(index, map[string]int64{}), "1 documents of unknown products")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, indexer.NewSearchIndex(time.Hour).Put(cancelled, indexer.Document{SKU: "x"}), context.Canceled)

	_, err := indexer.NewIndexer(indexer.IndexerConfig{})
	require.ErrorContains(t, err, "IndexerConfig.Index")
	_, err = indexer.NewCatalogue(indexer.CatalogueConfig{})
	require.ErrorContains(t, err, "CatalogueConfig.Pool")
}

// On SQLite (the embedded demo): the catalogue and the indexer in files of
// their own, the filter reading the catalogue's latest table through
// LatestDB. Only the latest update of each product is indexed.
func TestIndexerProcessesOnlyTheLatestSQLite(t *testing.T) {
	t.Parallel()
	const products, updates = 4, 20
	ctx := context.Background()
	catDB, ixDB := testenv.SQLiteDB(t), testenv.SQLiteDB(t)
	cat, err := indexer.NewCatalogue(indexer.CatalogueConfig{DB: catDB})
	require.NoError(t, err)
	require.NoError(t, cat.Migrate(ctx))
	require.NoError(t, cat.Migrate(ctx), "idempotent")
	n, err := cat.Import(ctx, indexer.ImportConfig{Products: products, UpdatesPerProduct: updates, Workers: 2})
	require.NoError(t, err)
	require.Equal(t, products*updates, n)

	index := indexer.NewSearchIndex(-1)
	ix, err := indexer.NewIndexer(indexer.IndexerConfig{Index: index, LatestDB: idempotency.SQL(catDB, idempotency.SQLite), Dialect: idempotency.SQLite})
	require.NoError(t, err)
	require.NoError(t, ix.MigrateDB(ctx, shop.SQLiteDB(ixDB), processed.Config{}))
	rec := newAttempts()
	broker := shop.NewChannelBroker(nil)
	t.Cleanup(func() { _ = broker.Close() })
	require.NoError(t, broker.Declare(indexer.Consumer))
	sub, err := broker.Subscriber(indexer.Consumer, nil)
	require.NoError(t, err)
	poison, topic, err := broker.PoisonPublisher(indexer.Consumer, nil)
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: indexer.Consumer.Name,
		DB:       idempotency.SQL(ixDB, idempotency.SQLite),
		Recorder: ix.Recorder(rec),
		Poison:   middleware.PoisonConfig{Publisher: poison, Topic: topic},
		Retry:    middleware.RetryConfig{InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
	}, nil)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	_, err = c.AddConsumerHandler(router, indexer.Consumer.Name, indexer.EventProductUpdated, sub, ix.Handle)
	require.NoError(t, err)
	runInBackground(t, router.Run, router.Running(), router.Close)
	startRelay(t, cat, broker.Publisher())
	rec.wait(t, n, 0)

	want, err := cat.Versions(ctx)
	require.NoError(t, err)
	require.Len(t, want, products)
	require.NoError(t, indexer.CheckLatest(index, want))
	require.Equal(t, indexer.Stats{IndexUpdates: products, ObsoleteSkipped: int64(n - products)}, ix.Stats())
	dead, err := broker.DrainDeadLetters(indexer.Consumer)
	require.NoError(t, err)
	require.Empty(t, dead)
}
