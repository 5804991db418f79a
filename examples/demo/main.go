// Command demo runs the example shop end to end and injects the faults of
// at-least-once delivery, then checks from the databases and queues that
// every effect happened exactly once.
//
//	go run ./examples/demo            # 1000 orders, 100 products × 10 updates, under a minute
//	go run ./examples/demo -orders 100 -cut-every 20
//	DATABASE_URL=postgres://… AMQP_URL=amqp://… go run ./examples/demo
//
// Two backends (-backend):
//
//   - embedded, the default when neither DATABASE_URL nor AMQP_URL is set:
//     nothing to install. Each service's database is a SQLite file
//     (modernc.org/sqlite, pure Go) in a temporary directory, and the broker
//     is shop.ChannelBroker: Watermill's in-process pub/sub (GoChannel) as the
//     exchange and an in-memory queue per consumer that requeues nacked
//     deliveries and redelivers the ones whose ack a cut lost, as RabbitMQ
//     does. The outboxes are the library's (package outbox) in its SQLite
//     dialect; billing's operation records live in a
//     SQLite file of their own (one writer per file).
//
//   - services, the default when either is set: PostgreSQL (a schema per
//     service) and RabbitMQ (the shop topology, a TCP fault proxy in front
//     of each consumer).
//
//   - jetstream: PostgreSQL as above and NATS JetStream at NATS_URL (default
//     nats://127.0.0.1:4222): shop.JetStreamTransport, an events stream, a
//     durable consumer per service, a TCP fault proxy in front of each
//     consumer's NATS connection.
//
//   - kafka: PostgreSQL as above and an in-process Kafka-protocol cluster
//     (kfake): the demo builds and starts examples/demo/kafkapeer (a module
//     of its own, Go 1.26) with the go command, so it runs from the
//     repository (go run). shop.KafkaTransport: a topic per event name, a
//     consumer group per consumer and topic (watermill-kafka v3, Sarama);
//     a cut closes the consumer's group members before the ack, and the
//     partitions are consumed again from the last committed offset.
//
// The faults and the checks are the same on all four.
//
// One process runs the producers and the consumers of the example shop, each
// consumer a shop.Service built on middleware.NewConsumer (the whole
// chain), on its own database (PostgreSQL schema or SQLite file):
//
//   - order (producer): orders and their status changes, through its outbox
//     and relay (package outbox);
//   - stock: reserves each order line once;
//   - shipping: keeps a versioned copy of each order's status;
//   - billing: charges each placed order once at a fake payment provider
//     (operation keys; the provider times out after charging every
//     -provider-timeout-every-th charge, and the retry reconciles by key), and
//     produces a confirmation request through its own transactional outbox
//     and relay; uncertain charges would go to its reconciliation queue;
//   - billing-mailer: sends one e-mail per confirmation request (a fake
//     mailer that does not honour idempotency keys);
//   - catalogue (producer): imports -products products, each updated
//     -updates times, through its outbox and relay, recording the latest
//     update of each product;
//   - indexer: pushes products to a slow fake search index, only the latest
//     update of each (the others are acked as obsolete or stale).
//
// The faults:
//
//   - relay republish: each relay (order, catalogue, billing) fails to store
//     its position after a share of batches (-relay-fail), as after a crash
//     between the broker's confirm and the commit of its position: those rows
//     are published again, same ids;
//   - lost ack: after every -cut-every-th committed delivery, the consumer's
//     AMQP connection is cut (through a TCP fault proxy; embedded, the broker
//     loses the acks of the deliveries in flight) before the ack: the
//     broker redelivers the message with redelivered=true; every consumer;
//   - operator replay: the order and catalogue events of the first -replay
//     share of the run are republished from the outboxes with their
//     original ids;
//   - malformed messages: -malformed raw bodies (empty, truncated JSON,
//     event_id missing, "not-a-uuid", "", 12345) published to the exchange
//     with each consumed event name, so every consumer queue gets each once;
//   - out of order: for a share of orders and of products (-reorder) a
//     status change or product update is held back until a later one was
//     published;
//   - provider timeouts: see billing above.
//
// With -id-at-reception the consumers replace each delivery's event id by a
// new one before the middleware sees it (the mistake of assigning ids on
// reception): the duplicates then pass the claim and the checks fail.
//
// It prints a progress line on stderr, a table, and as the last line of
// stdout one JSON object (orders, deliveries, reservations,
// expected_reservations, duplicates_skipped, stale_skipped, poisoned, lost,
// charges, expected_charges, mails, index_updates, obsolete_skipped, ok, …). The exit status is 1 when ok is false, 2 when the run could not be
// set up. Each run uses its own PostgreSQL schemas and RabbitMQ exchange and
// queues (a random prefix), or its own temporary directory of SQLite files,
// and removes them at the end unless -keep.
//
// DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test?sslmode=disable)
// and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) locate the
// services of -backend services.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/watermill-idempotency/idempotency/examples/indexer"
)

// config is the demo's sizes, fault rates and service URLs.
type config struct {
	// Backend is backendEmbedded (SQLite files and the in-process broker),
	// backendServices (PostgreSQL at DatabaseURL, RabbitMQ at AMQPURL),
	// backendJetStream or backendKafka (PostgreSQL and NATS JetStream or an
	// in-process Kafka).
	Backend     string
	DatabaseURL string
	AMQPURL     string
	NATSURL     string // backendJetStream

	Orders               int           // orders to place
	MaxLines             int           // lines per order, 1..MaxLines
	StatusChanges        int           // status changes per order after "placed"
	Producers            int           // concurrent producers
	Workers              int           // subscriptions per consumer queue
	Prefetch             int           // consumer prefetch
	BatchSize            int           // relay batch size
	RelayFail            float64       // share of relay publishes whose confirm is lost (republished)
	OpenTx               bool          // a session keeps a write transaction open on the server all run (PostgreSQL)
	CutEvery             int           // cut a consumer's connection after every n-th commit (0: never)
	ReplayShare          float64       // share of the run's time range replayed by the operator
	Malformed            int           // malformed messages published raw
	Reorder              float64       // share of orders (products) whose status changes (updates) are reordered
	Products             int           // products of the catalogue import
	Updates              int           // updates per product
	IndexLatency         time.Duration // the fake search index's time per document (0: none)
	ProviderTimeoutEvery int           // every n-th charge times out after it was made (0: never)
	Seed                 uint64
	Timeout              time.Duration
	Keep                 bool
	Verbose              bool
	IDAtReception        bool          // the classic mistake, to show what the checks catch
	Partitioned          bool          // stock and shipping on processed.LayoutPartitioned (PostgreSQL)
	Progress             time.Duration // progress line interval
}

func defaultConfig() config {
	return config{
		Backend:              defaultBackend(),
		DatabaseURL:          envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"),
		AMQPURL:              envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		NATSURL:              envOr("NATS_URL", "nats://127.0.0.1:4222"),
		Orders:               1000,
		MaxLines:             3,
		StatusChanges:        2,
		Producers:            4,
		Workers:              1,
		Prefetch:             16,
		BatchSize:            50,
		RelayFail:            0.2,
		OpenTx:               true,
		CutEvery:             150,
		ReplayShare:          0.1,
		Malformed:            6,
		Reorder:              0.05,
		Products:             100,
		Updates:              10,
		IndexLatency:         indexer.DefaultIndexLatency,
		ProviderTimeoutEvery: 40,
		Seed:                 uint64(time.Now().UnixNano()),
		Timeout:              2 * time.Minute,
		Progress:             500 * time.Millisecond,
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	c := defaultConfig()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.Backend, "backend", c.Backend, "embedded (SQLite and the in-process broker: nothing to install), services (PostgreSQL at DATABASE_URL, RabbitMQ at AMQP_URL), jetstream (PostgreSQL at DATABASE_URL, NATS JetStream at NATS_URL) or kafka (PostgreSQL at DATABASE_URL, an in-process Kafka-protocol cluster the demo builds and starts: run it from the repository); defaults to services when DATABASE_URL or AMQP_URL is set")
	fs.IntVar(&c.Orders, "orders", c.Orders, "orders to place")
	fs.IntVar(&c.MaxLines, "lines", c.MaxLines, "maximum lines per order (1..n)")
	fs.IntVar(&c.StatusChanges, "status-changes", c.StatusChanges, "status changes per order after it is placed (0..3)")
	fs.IntVar(&c.Producers, "producers", c.Producers, "concurrent producers")
	fs.IntVar(&c.Workers, "workers", c.Workers, "subscriptions per consumer queue (above 1, a cut may also break another worker's ack: a poisoned message may then reach the dead-letter queue twice)")
	fs.IntVar(&c.Prefetch, "prefetch", c.Prefetch, "consumer prefetch")
	fs.IntVar(&c.BatchSize, "batch", c.BatchSize, "relay batch size")
	fs.Float64Var(&c.RelayFail, "relay-fail", c.RelayFail, "share of relay publishes whose confirm is lost (republished)")
	fs.BoolVar(&c.OpenTx, "open-tx", c.OpenTx, "keep a write transaction open in another database of the PostgreSQL server for the whole run (the relays must not wait for it)")
	fs.IntVar(&c.CutEvery, "cut-every", c.CutEvery, "cut a consumer's AMQP connection after every n-th commit, before the ack (0: never)")
	fs.Float64Var(&c.ReplayShare, "replay", c.ReplayShare, "share of the run's time range the operator replays")
	fs.IntVar(&c.Malformed, "malformed", c.Malformed, "malformed messages published raw")
	fs.Float64Var(&c.Reorder, "reorder", c.Reorder, "share of orders (products) whose status changes (updates) arrive out of order")
	fs.IntVar(&c.Products, "products", c.Products, "products of the catalogue import")
	fs.IntVar(&c.Updates, "updates", c.Updates, "updates per product")
	fs.DurationVar(&c.IndexLatency, "index-latency", c.IndexLatency, "time the fake search index takes per document (0: none)")
	fs.IntVar(&c.ProviderTimeoutEvery, "provider-timeout-every", c.ProviderTimeoutEvery, "the payment provider times out after making every n-th charge (0: never)")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "random seed of the fault injection")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "give up waiting for the work to settle after this")
	fs.BoolVar(&c.Keep, "keep", c.Keep, "keep the run's schemas, exchange and queues")
	fs.BoolVar(&c.Verbose, "v", c.Verbose, "log Watermill and the middleware to stderr")
	fs.BoolVar(&c.IDAtReception, "id-at-reception", c.IDAtReception, "break it on purpose: give each delivery a new event id on reception (the classic mistake) and watch the checks fail")
	fs.BoolVar(&c.Partitioned, "partitioned", c.Partitioned, "stock and shipping keep their processed events in the partitioned layout (processed.LayoutPartitioned, PostgreSQL only: -backend services)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.Partitioned && c.Backend != backendServices {
		return c, fmt.Errorf("-partitioned needs PostgreSQL: -backend services")
	}
	switch {
	case c.Backend != backendEmbedded && c.Backend != backendServices && c.Backend != backendJetStream && c.Backend != backendKafka:
		return c, fmt.Errorf("-backend %q: embedded, services, jetstream or kafka", c.Backend)
	case c.Orders < 1:
		return c, fmt.Errorf("-orders %d: must be ≥ 1", c.Orders)
	case c.MaxLines < 1:
		return c, fmt.Errorf("-lines %d: must be ≥ 1", c.MaxLines)
	case c.StatusChanges < 0 || c.StatusChanges > len(statuses):
		return c, fmt.Errorf("-status-changes %d: must be 0..%d", c.StatusChanges, len(statuses))
	case c.Producers < 1 || c.Workers < 1 || c.Prefetch < 1 || c.BatchSize < 1:
		return c, fmt.Errorf("-producers, -workers, -prefetch and -batch must be ≥ 1")
	case c.RelayFail < 0 || c.RelayFail > 1 || c.ReplayShare < 0 || c.ReplayShare > 1 || c.Reorder < 0 || c.Reorder > 1:
		return c, fmt.Errorf("-relay-fail, -replay and -reorder are shares in [0, 1]")
	case c.CutEvery < 0 || c.Malformed < 0 || c.ProviderTimeoutEvery < 0 || c.IndexLatency < 0:
		return c, fmt.Errorf("-cut-every, -malformed, -provider-timeout-every and -index-latency must be ≥ 0")
	case c.Products < 1 || c.Updates < 1:
		return c, fmt.Errorf("-products and -updates must be ≥ 1")
	}
	return c, nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if err == flag.ErrHelp {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, cfg, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
