package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// env owns what a run creates on the services: schemas (dropped with CASCADE
// at the end), pools (closed), queues and JetStream streams (deleted). Every
// name is random (testenv.UniqueName), so runs and tests can share the
// servers.
type env struct {
	pgURL   string
	amqpURL string
	natsURL string
	log     io.Writer

	admin *pgxpool.Pool

	mu      sync.Mutex
	schemas []string
	queues  []string
	streams []string
	pools   []*pgxpool.Pool
	nc      *nats.Conn // opened by jetStream, closed by close
	js      nats.JetStreamContext
}

func newEnv(ctx context.Context, log io.Writer) (*env, error) {
	e := &env{pgURL: testenv.PostgresURL(), amqpURL: testenv.AMQPURL(), natsURL: testenv.NATSURL(), log: log}
	cfg, err := pgxpool.ParseConfig(e.pgURL)
	if err != nil {
		return nil, fmt.Errorf("bench: PostgreSQL URL %s: %w", e.pgURL, err)
	}
	cfg.MaxConns = 4
	e.admin, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("bench: PostgreSQL at %s: %w", e.pgURL, err)
	}
	if err := e.admin.Ping(ctx); err != nil {
		e.admin.Close()
		return nil, fmt.Errorf("bench: PostgreSQL at %s unreachable (make services): %w", e.pgURL, err)
	}
	return e, nil
}

// schema creates a fresh schema named prefix_<random>.
func (e *env) schema(ctx context.Context, prefix string) (string, error) {
	name := testenv.UniqueName("bench_" + prefix)
	if _, err := e.admin.Exec(ctx, "CREATE SCHEMA "+name); err != nil {
		return "", fmt.Errorf("bench: create schema: %w", err)
	}
	e.mu.Lock()
	e.schemas = append(e.schemas, name)
	e.mu.Unlock()
	return name, nil
}

// pool opens a pool whose sessions use schema as search_path. Pool settings
// are pgx's defaults (statement cache on) except MaxConns.
func (e *env) pool(ctx context.Context, schema string, maxConns int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.pgURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = int32(maxConns)
	cfg.MinConns = int32(maxConns)
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := p.Ping(ctx); err != nil {
		p.Close()
		return nil, err
	}
	e.mu.Lock()
	e.pools = append(e.pools, p)
	e.mu.Unlock()
	return p, nil
}

// store migrates a processed-event table schema.table and returns its store.
func (e *env) store(ctx context.Context, pool *pgxpool.Pool, schema, table string) (*processedstore.Store, error) {
	s, err := processedstore.NewStore(processedstore.Config{Table: schema + "." + table, Horizon: time.Hour}) // = the purge part's horizon
	if err != nil {
		return nil, err
	}
	if err := s.Migrate(ctx, sqldb.Pgx(pool)); err != nil {
		return nil, err
	}
	// As NewConsumer: the lean claim, and the UUIDv7 claim table.
	if err := s.CheckLean(ctx, sqldb.Pgx(pool), consumerName); err != nil {
		return nil, err
	}
	return s, nil
}

// queue declares a durable queue with a random name.
func (e *env) queue(prefix string) (string, error) {
	name := testenv.UniqueName("bench_" + prefix)
	conn, err := amqp091.Dial(e.amqpURL)
	if err != nil {
		return "", fmt.Errorf("bench: RabbitMQ at %s unreachable (make services): %w", e.amqpURL, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return "", err
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		return "", err
	}
	e.mu.Lock()
	e.queues = append(e.queues, name)
	e.mu.Unlock()
	return name, nil
}

// deleteQueues deletes the queues created so far (between rounds, so that
// the broker does not accumulate them).
func (e *env) deleteQueues() {
	e.mu.Lock()
	qs := e.queues
	e.queues = nil
	e.mu.Unlock()
	if len(qs) == 0 {
		return
	}
	conn, err := amqp091.Dial(e.amqpURL)
	if err != nil {
		e.mu.Lock()
		e.queues = append(e.queues, qs...)
		e.mu.Unlock()
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	for _, q := range qs {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
}

// close removes everything the run created, on a context of its own so that
// an interrupted run still cleans up.
func (e *env) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.pools {
		p.Close()
	}
	e.pools = nil
	for _, s := range e.schemas {
		if _, err := e.admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE"); err != nil {
			fmt.Fprintf(e.log, "bench: drop schema %s: %v\n", s, err)
		}
	}
	e.schemas = nil
	if len(e.queues) > 0 {
		if conn, err := amqp091.Dial(e.amqpURL); err == nil {
			if ch, err := conn.Channel(); err == nil {
				for _, q := range e.queues {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
				_ = ch.Close()
			}
			_ = conn.Close()
		}
	}
	e.queues = nil
	if e.js != nil {
		for _, s := range e.streams {
			if err := e.js.DeleteStream(s, nats.Context(ctx)); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
				fmt.Fprintf(e.log, "bench: delete stream %s: %v\n", s, err)
			}
		}
		e.nc.Close()
	}
	e.streams = nil
	e.admin.Close()
}

// jetStream returns the run's JetStream context, connecting on first use
// (NATS_URL or testenv's default).
func (e *env) jetStream() (nats.JetStreamContext, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.js != nil {
		return e.js, nil
	}
	nc, err := nats.Connect(e.natsURL)
	if err != nil {
		return nil, fmt.Errorf("bench: NATS at %s unreachable (make services): %w", e.natsURL, err)
	}
	js, err := nc.JetStream()
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("bench: JetStream at %s: %w", e.natsURL, err)
	}
	e.nc, e.js = nc, js
	return js, nil
}

// trackStream records a stream the run created, deleted by dropStream or
// close.
func (e *env) trackStream(name string) {
	e.mu.Lock()
	e.streams = append(e.streams, name)
	e.mu.Unlock()
}

// dropStream deletes a stream of the run now; on failure close retries.
func (e *env) dropStream(name string) {
	js, err := e.jetStream()
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := js.DeleteStream(name, nats.Context(ctx)); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, s := range e.streams {
		if s == name {
			e.streams = append(e.streams[:i], e.streams[i+1:]...)
			break
		}
	}
}

// closePool closes p now (a part's pool), instead of at the end of the run.
func (e *env) closePool(p *pgxpool.Pool) {
	e.mu.Lock()
	for i, q := range e.pools {
		if q == p {
			e.pools = append(e.pools[:i], e.pools[i+1:]...)
			break
		}
	}
	e.mu.Unlock()
	p.Close()
}

// serverInfo returns the PostgreSQL and RabbitMQ versions and the
// settings that shape the numbers.
func (e *env) serverInfo(ctx context.Context) map[string]string {
	out := map[string]string{}
	for _, s := range []string{"server_version", "synchronous_commit", "fsync", "shared_buffers", "wal_level", "autovacuum", "max_wal_size"} {
		var v string
		if err := e.admin.QueryRow(ctx, "SELECT current_setting($1)", s).Scan(&v); err == nil {
			out["pg_"+s] = v
		}
	}
	if conn, err := amqp091.Dial(e.amqpURL); err == nil {
		if v, ok := conn.Properties["version"].(string); ok {
			out["rabbitmq_version"] = v
		}
		_ = conn.Close()
	}
	return out
}
