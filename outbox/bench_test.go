package outbox_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// Benchmarks of the relay (run with -benchtime=1x: each iteration is a whole
// measurement). The bench command's relay part (bench/relay.go, `go run
// ./bench/cmd/idembench -parts relay`) measures the same latency and table
// at rest and writes bench/RESULTS.md; these stay for the comparison with
// watermill-sql's forwarder and for profiling:
//
//	go test -run '^$' -bench 'Relay' -benchtime=1x ./outbox/
//
// OUTBOX_BENCH_HOLD (default 5s; the figure is 60s) is how long the
// session in another database keeps its write transaction open;
// OUTBOX_BENCH_N (default 10000; 100000 for the figure) the rows of
// BenchmarkRelayTableAtRest.

func benchEnv(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func benchHold() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("OUTBOX_BENCH_HOLD")); err == nil && d > 0 {
		return d
	}
	return 5 * time.Second
}

// arrivals timestamps each message a relay delivers.
type arrivals struct {
	mu  sync.Mutex
	at  map[string]time.Time
	got chan struct{}
}

func newArrivals() *arrivals {
	return &arrivals{at: map[string]time.Time{}, got: make(chan struct{}, 1<<16)}
}

func (a *arrivals) Publish(_ string, msgs ...*message.Message) error {
	now := time.Now()
	a.mu.Lock()
	for _, m := range msgs {
		if _, ok := a.at[m.UUID]; !ok {
			a.at[m.UUID] = now
		}
	}
	a.mu.Unlock()
	select {
	case a.got <- struct{}{}:
	default:
	}
	return nil
}

func (a *arrivals) Close() error { return nil }

func (a *arrivals) arrived(id string) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, ok := a.at[id]
	return t, ok
}

// holdOtherDatabase opens BEGIN; SELECT pg_current_xact_id() in database
// "postgres" and returns its rollback.
func holdOtherDatabase(b *testing.B) func() {
	b.Helper()
	ctx := context.Background()
	u, err := url.Parse(testenv.PostgresURL())
	if err != nil {
		b.Fatal(err)
	}
	u.Path = "/postgres"
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		b.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_current_xact_id()`); err != nil {
		b.Fatal(err)
	}
	return func() {
		_ = tx.Rollback(context.Background())
		_ = conn.Close(context.Background())
	}
}

// latencyRun writes one message every 20 ms for d (each in its own
// transaction, through write) and returns each one's delay from commit to
// arrival at dest; it waits up to d+30 s for the stragglers.
func latencyRun(b *testing.B, d time.Duration, write func(id string) error, dest *arrivals) []time.Duration {
	b.Helper()
	type sentAt struct {
		id string
		at time.Time
	}
	var sent []sentAt
	for start := time.Now(); time.Since(start) < d; time.Sleep(20 * time.Millisecond) {
		id := newID()
		if err := write(id); err != nil {
			b.Fatal(err)
		}
		sent = append(sent, sentAt{id, time.Now()})
	}
	deadline := time.Now().Add(d + 30*time.Second)
	out := make([]time.Duration, 0, len(sent))
	for _, s := range sent {
		for {
			if at, ok := dest.arrived(s.id); ok {
				out = append(out, at.Sub(s.at))
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("%s never arrived", s.id)
			}
			select {
			case <-dest.got:
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	return out
}

func pct(ds []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func reportLatency(b *testing.B, name string, ds []time.Duration) {
	b.ReportMetric(float64(pct(ds, 0.50).Microseconds())/1000, name+"_p50_ms")
	b.ReportMetric(float64(pct(ds, 0.99).Microseconds())/1000, name+"_p99_ms")
	b.Logf("%-28s n=%d p50=%s p99=%s max=%s", name, len(ds), pct(ds, 0.5), pct(ds, 0.99), pct(ds, 1))
}

// BenchmarkRelayLatency: delivery latency (commit → the relay's publish to
// an in-process broker) of this package's relay, while idle and while a
// session in another database of the server holds a write transaction open
// for OUTBOX_BENCH_HOLD; and, for contrast, watermill-sql v4's PostgreSQL
// schema behind Watermill's forwarder (what the outbox used before) under
// the same open transaction.
func BenchmarkRelayLatency(b *testing.B) {
	hold := benchHold()
	for i := 0; i < b.N; i++ {
		ctx := context.Background()
		pool, _ := testenv.Pool(b)
		ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "bench_outbox"}, nil)
		if err != nil {
			b.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		dest := newArrivals()
		r, err := ob.NewRelay(dest, outbox.RelayConfig{})
		if err != nil {
			b.Fatal(err)
		}
		go func() { _ = r.Run(ctx) }()
		<-r.Running()
		write := func(id string) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				pub, err := ob.PgxPublisher(tx)
				if err != nil {
					return err
				}
				return pub.Publish("events", msg(id))
			})
		}
		reportLatency(b, "idle", latencyRun(b, hold, write, dest))
		release := holdOtherDatabase(b)
		reportLatency(b, "open_tx_elsewhere", latencyRun(b, hold, write, dest))
		release()
		_ = r.Close()

		// Before: watermill-sql v4 + forwarder, same open transaction.
		reportLatency(b, "wsql_forwarder_open_tx", forwarderLatency(b, pool, hold))
	}
}

func forwarderLatency(b *testing.B, pool *pgxpool.Pool, hold time.Duration) []time.Duration {
	b.Helper()
	ctx := context.Background()
	logger := watermill.NopLogger{}
	db := wsql.BeginnerFromPgx(pool)
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     outbox.DefaultPollInterval,
	}, logger)
	if err != nil {
		b.Fatal(err)
	}
	if err := sub.SubscribeInitialize("bench_fwd"); err != nil {
		b.Fatal(err)
	}
	dest := newArrivals()
	fwd, err := forwarder.NewForwarder(sub, dest, logger, forwarder.Config{ForwarderTopic: "bench_fwd"})
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = fwd.Run(ctx) }()
	defer fwd.Close()
	<-fwd.Running()
	write := func(id string) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
			if err != nil {
				return err
			}
			m := msg(id)
			m.SetContext(ctx)
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "bench_fwd"}).Publish("events", m)
		})
	}
	release := holdOtherDatabase(b)
	go func() { time.Sleep(hold); release() }()
	return latencyRun(b, hold, write, dest)
}

// BenchmarkRelayTableAtRest relays OUTBOX_BENCH_N rows (written 1000 per
// transaction) and reports the relay's throughput and the outbox table's
// rows once everything arrived (expected 0: relayed rows are deleted).
func BenchmarkRelayTableAtRest(b *testing.B) {
	n := benchEnv("OUTBOX_BENCH_N", 10000)
	for i := 0; i < b.N; i++ {
		ctx := context.Background()
		pool, _ := testenv.Pool(b)
		ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "bench_outbox"}, nil)
		if err != nil {
			b.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		for written := 0; written < n; {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				pub, err := ob.PgxPublisher(tx)
				if err != nil {
					return err
				}
				for j := 0; j < 1000 && written < n; j++ {
					if err := pub.Publish("events", msg(newID())); err != nil {
						return err
					}
					written++
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
		}
		dest := newArrivals()
		r, err := ob.NewRelay(dest, outbox.RelayConfig{})
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		go func() { _ = r.Run(ctx) }()
		for {
			dest.mu.Lock()
			got := len(dest.at)
			dest.mu.Unlock()
			if got >= n {
				break
			}
			if time.Since(start) > 10*time.Minute {
				b.Fatalf("relayed %d of %d in 10 min", got, n)
			}
			time.Sleep(10 * time.Millisecond)
		}
		elapsed := time.Since(start)
		// The last round deletes its rows when it commits, just after its
		// publishes: wait for it (Close would roll an unfinished round back,
		// leaving its rows to be published again).
		var rows int
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM bench_outbox`).Scan(&rows); err != nil {
				b.Fatal(err)
			}
			if rows == 0 || time.Now().After(deadline) {
				break
			}
		}
		_ = r.Close()
		b.ReportMetric(float64(n)/elapsed.Seconds(), "relayed_msg/s")
		b.ReportMetric(float64(rows), "rows_at_rest")
		b.Logf("relayed %d rows in %s (%.0f msg/s); outbox rows after: %d", n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds(), rows)
		if rows != 0 {
			b.Fatal(fmt.Sprintf("%d rows left in the outbox", rows))
		}
	}
}

// BenchmarkProducerInsert: one Publish of one message through
// Outbox.PgxPublisher on a pool in pgx's default exec mode
// (cache_statement) and in exec. in_tx publishes into one open
// transaction (the insert alone); tx_per_row commits each row in a
// transaction of its own (what a producer writing one event pays).
func BenchmarkProducerInsert(b *testing.B) {
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		b.Run(mode.String(), func(b *testing.B) {
			ctx := context.Background()
			cfg := testenv.PoolConfig(b, testenv.PostgresURL(), testenv.Schema(b), 2)
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(pool.Close)
			ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "bench_outbox"}, nil)
			if err != nil {
				b.Fatal(err)
			}
			if err := ob.Migrate(ctx); err != nil {
				b.Fatal(err)
			}
			msgs := func(n int) []*message.Message {
				ms := make([]*message.Message, n)
				for i := range ms {
					ms[i] = msg(newID())
				}
				return ms
			}
			b.Run("in_tx", func(b *testing.B) {
				ms := msgs(b.N)
				tx, err := pool.Begin(ctx)
				if err != nil {
					b.Fatal(err)
				}
				defer func() { _ = tx.Rollback(ctx) }()
				pub, err := ob.PgxPublisher(tx)
				if err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := pub.Publish("events", ms[i]); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("tx_per_row", func(b *testing.B) {
				ms := msgs(b.N)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						pub, err := ob.PgxPublisher(tx)
						if err != nil {
							return err
						}
						return pub.Publish("events", ms[i])
					})
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
