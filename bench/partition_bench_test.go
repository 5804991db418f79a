package bench

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// BenchmarkRetentionDropVsDelete measures retention of N expired rows
// (BENCH_PARTITION_ROWS, default 1,000,000) two ways while 2 workers claim
// fresh events (one claim per transaction, as the middleware does):
//
//   - drop: processedstore.LayoutPartitioned, the N rows in one expired time
//     partition, removed by the Purger's DROP (MaintainPartitions);
//   - delete: LayoutPlain, the same N rows removed by the Purger's DELETE
//     batches (DefaultPurgeBatchSize).
//
// Reported per way: the retention's duration, rows per second, and the p99
// and maximum latency of the claims that overlapped it, next to the p99 of
// claims before it. It is a benchmark, not a test: run it by hand,
//
//	BENCH_PARTITION_ROWS=10000000 go test -run '^$' -bench RetentionDropVsDelete -benchtime 1x ./bench/
func BenchmarkRetentionDropVsDelete(b *testing.B) {
	rows := 1_000_000
	if s := os.Getenv("BENCH_PARTITION_ROWS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			b.Fatal(err)
		}
		rows = n
	}
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		for _, layout := range []processedstore.Layout{processedstore.LayoutPartitioned, processedstore.LayoutPlain} {
			name := map[processedstore.Layout]string{processedstore.LayoutPartitioned: "drop", processedstore.LayoutPlain: "delete"}[layout]
			r, err := retentionRun(ctx, b, layout, rows)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(r.took.Seconds(), name+"_s")
			b.ReportMetric(float64(rows)/r.took.Seconds(), name+"_rows/s")
			b.ReportMetric(ms(r.p99During), name+"_claim_p99_ms")
			b.ReportMetric(ms(r.maxDuring), name+"_claim_max_ms")
			b.ReportMetric(ms(r.p99Before), name+"_claim_p99_before_ms")
			b.ReportMetric(float64(r.claimsDuring), name+"_claims_during")
			b.Logf("%s: %d rows in %s (fill %s); claims during: %d, p99 %s, max %s; p99 before %s",
				name, rows, r.took, r.fill, r.claimsDuring, r.p99During, r.maxDuring, r.p99Before)
		}
	}
}

type retentionResult struct {
	took, fill                      time.Duration
	p99Before, p99During, maxDuring time.Duration
	claimsDuring                    int
}

func retentionRun(ctx context.Context, b *testing.B, layout processedstore.Layout, rows int) (retentionResult, error) {
	var res retentionResult
	schema := testenv.Schema(b)
	cfg := testenv.PoolConfig(b, testenv.PostgresURL(), schema, 6)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return res, err
	}
	defer pool.Close()
	const horizon = 2 * time.Hour
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Layout: layout, Horizon: horizon})
	if err != nil {
		return res, err
	}
	if err := store.Migrate(ctx, sqldb.Pgx(pool)); err != nil {
		return res, err
	}
	purger, err := processedstore.NewPurger(store, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	if err != nil {
		return res, err
	}
	if _, _, err := purger.PurgeNow(ctx); err != nil { // partitions ahead
		return res, err
	}
	// The expired rows: UUIDv7 ids of one span 5 h ago, in id order.
	start := time.Now().Add(-5 * time.Hour).UTC().Truncate(time.Hour)
	if layout == processedstore.LayoutPartitioned {
		part := fmt.Sprintf("%s.processed_event_p%s", schema, start.Format("200601021504"))
		if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF %s.processed_event FOR VALUES FROM ('%s') TO ('%s')`,
			part, schema, v7Floor(start), v7Floor(start.Add(time.Hour)))); err != nil {
			return res, err
		}
	}
	t0 := time.Now()
	step := int64(time.Hour/time.Millisecond) / int64(rows+1) // ms between rows (0: several per ms)
	if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s.processed_event (consumer, event_id, event_at)
SELECT 'bench', (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' || substr(r, 20, 17))::uuid,
       to_timestamp(ms / 1000.0)
FROM (SELECT $1::bigint + i * $3::bigint AS ms, lpad(to_hex($1::bigint + i * $3::bigint), 12, '0') AS h, gen_random_uuid()::text AS r
      FROM generate_series(1, $2::bigint) AS i) AS s`, schema), start.UnixMilli(), rows, step); err != nil {
		return res, err
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+schema+".processed_event"); err != nil {
		return res, err
	}
	res.fill = time.Since(t0)

	type sample struct {
		at  time.Time
		dur time.Duration
	}
	var mu sync.Mutex
	var samples []sample
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				s := time.Now()
				tx, err := pool.Begin(ctx)
				if err != nil {
					return
				}
				_, err = store.Claim(ctx, sqldb.Pgx(tx), "live", uuid.Must(uuid.NewV7()))
				if err == nil {
					err = tx.Commit(ctx)
				} else {
					_ = tx.Rollback(ctx)
				}
				if err != nil {
					return
				}
				mu.Lock()
				samples = append(samples, sample{s, time.Since(s)})
				mu.Unlock()
			}
		}()
	}
	time.Sleep(2 * time.Second) // the baseline
	begin := time.Now()
	if _, _, err := purger.PurgeNow(ctx); err != nil {
		close(stop)
		wg.Wait()
		return res, err
	}
	end := time.Now()
	res.took = end.Sub(begin)
	time.Sleep(200 * time.Millisecond)
	close(stop)
	wg.Wait()
	var before, during []time.Duration
	for _, s := range samples {
		switch {
		case s.at.Before(begin) && s.at.Add(s.dur).Before(begin):
			before = append(before, s.dur)
		case s.at.Before(end):
			during = append(during, s.dur)
		}
	}
	sort.Slice(during, func(i, j int) bool { return during[i] < during[j] })
	res.p99Before, res.p99During, res.maxDuring, res.claimsDuring = percentile(before, 0.99), percentile(during, 0.99), maxDur(during), len(during)
	var left int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".processed_event WHERE consumer = 'bench'").Scan(&left); err != nil {
		return res, err
	}
	if left != 0 {
		return res, fmt.Errorf("%d expired rows left after the purge", left)
	}
	return res, nil
}

// v7Floor is the smallest UUID whose UUIDv7 timestamp is t.
func v7Floor(t time.Time) uuid.UUID {
	var id uuid.UUID
	ms := uint64(t.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	return id
}
