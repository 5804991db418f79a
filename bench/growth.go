package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// fillChunk bounds one INSERT … SELECT of the fill (progress, statement size).
const fillChunk = 1_000_000

// fillV7 inserts n processed rows with UUIDv7 ids whose timestamps are one
// millisecond apart, increasing, and all older than now: the order a real
// consumer claims them in (append-only on the primary key).
const fillV7 = `INSERT INTO %s (consumer, event_id)
SELECT 'bench', (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' || substr(r, 20, 17))::uuid
FROM (SELECT lpad(to_hex($1::bigint + i), 12, '0') AS h, gen_random_uuid()::text AS r
      FROM generate_series($2::bigint, $3::bigint) AS i) AS s`

// fillV4 inserts n processed rows with random (v4) ids.
const fillV4 = `INSERT INTO %s (consumer, event_id) SELECT 'bench', gen_random_uuid() FROM generate_series($1::bigint, $2::bigint)`

type growthTable struct {
	version string // "v7" or "v4"
	rows    int
	store   *processedstore.Store
	sink    *claimSink
	h       message.HandlerFunc
}

func (g growthTable) name() string { return fmt.Sprintf("%s_%s", g.version, rowsLabel(g.rows)) }

func rowsLabel(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n >= 1000 && n%1000 == 0:
		return strconv.Itoa(n/1000) + "k"
	default:
		return strconv.Itoa(n)
	}
}

// growth measures part 2: the claim latency (acquire + BEGIN + claim, as the
// middleware's Recorder sees it) with the processed table at each size, for
// UUIDv7 and UUIDv4 ids; tables of every size exist at once, so each round
// visits all of them (order rotated) and the ratio is the median over rounds
// of p99(largest) ÷ p99(empty). Then the WAL one claim writes (EXPLAIN
// (ANALYZE, WAL) of the claim statement, so other sessions' WAL does not
// count) and the table and index size per million rows.
func growth(ctx context.Context, e *env, sz GrowthSizes, checkpoint bool, res *Result) error {
	schema, err := e.schema(ctx, "growth")
	if err != nil {
		return err
	}
	pool, err := e.pool(ctx, schema, sz.Workers+1)
	if err != nil {
		return err
	}
	defer e.closePool(pool)
	if _, err := pool.Exec(ctx, handlerSchema); err != nil {
		return err
	}
	var tables []*growthTable
	for _, ver := range []string{"v7", "v4"} {
		for _, n := range sz.Rows {
			g := &growthTable{version: ver, rows: n, sink: &claimSink{}}
			// Table names are lower case: unquoted identifiers (the
			// migration's index name, regclass input) fold to it.
			if g.store, err = e.store(ctx, pool, schema, "p_"+strings.ToLower(g.name())); err != nil {
				return err
			}
			if err := fill(ctx, e, pool, g); err != nil {
				return err
			}
			idem, err := newIdempotent(pool, g.store, true, g.sink)
			if err != nil {
				return err
			}
			chain, _, err := chainWith(idem)
			if err != nil {
				return err
			}
			g.h = compose(handler(h1), chain...)
			tables = append(tables, g)
		}
	}

	type sample struct{ p50, p99 time.Duration }
	samples := map[*growthTable][]sample{}
	run := func(g *growthTable, dur time.Duration) ([]time.Duration, error) {
		gen := newV7
		if g.version == "v4" {
			gen = newV4
		}
		g.sink.start()
		_, err := runLoad(ctx, load{h: g.h, gen: gen, workers: sz.Workers, dur: dur, minCount: sz.MinCount}, nil)
		return g.sink.stop(), err
	}
	for _, g := range tables { // warm-up: statement caches, connections
		if _, err := run(g, sz.Dur/4); err != nil {
			return err
		}
	}
	for r := 0; r < sz.Rounds; r++ {
		fmt.Fprintf(e.log, "growth: round %d/%d\n", r+1, sz.Rounds)
		for _, g := range rotate(tables, r) {
			lat, err := run(g, sz.Dur)
			if err != nil {
				return fmt.Errorf("bench: growth %s: %w", g.name(), err)
			}
			samples[g] = append(samples[g], sample{percentile(lat, 0.5), percentile(lat, 0.99)})
		}
	}

	first := func(ver string) *growthTable {
		for _, g := range tables {
			if g.version == ver {
				return g
			}
		}
		return nil
	}
	last := func(ver string) *growthTable {
		var out *growthTable
		for _, g := range tables {
			if g.version == ver {
				out = g
			}
		}
		return out
	}
	perRound := func(a, b *growthTable, f func(x, y sample) float64) float64 {
		var xs []float64
		for i := range samples[a] {
			xs = append(xs, f(samples[a][i], samples[b][i]))
		}
		return median(xs)
	}
	p50r := func(x, y sample) float64 { return ratio(float64(x.p50), float64(y.p50)) }
	p99r := func(x, y sample) float64 { return ratio(float64(x.p99), float64(y.p99)) }
	medUS := func(g *growthTable, f func(s sample) time.Duration) float64 {
		var xs []float64
		for _, s := range samples[g] {
			xs = append(xs, us(f(s)))
		}
		return median(xs)
	}

	// WAL per claim and per duplicate, and sizes, at the largest size.
	type walRow struct {
		bytes, fpi, dupBytes float64 // the first WALClaims claims (after a checkpoint when asked)
		nextBytes, nextFPI   float64 // the next WALClaims claims
		heapMB, idxMB        float64
	}
	wal := map[*growthTable]walRow{}
	for _, ver := range []string{"v7", "v4"} {
		for _, g := range []*growthTable{first(ver), last(ver)} {
			if _, done := wal[g]; done {
				continue
			}
			if checkpoint {
				if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
					return fmt.Errorf("bench: checkpoint (needs superuser or pg_checkpoint): %w", err)
				}
			}
			b, f, d, err := walPerClaim(ctx, pool, g.store, ver, sz.WALClaims)
			if err != nil {
				return err
			}
			nb, nf, _, err := walPerClaim(ctx, pool, g.store, ver, sz.WALClaims)
			if err != nil {
				return err
			}
			row := walRow{bytes: b, fpi: f, dupBytes: d, nextBytes: nb, nextFPI: nf}
			if g.rows > 0 {
				var heap, idx int64
				if err := pool.QueryRow(ctx, `SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass)`,
					g.store.Table().Quoted('"')).Scan(&heap, &idx); err != nil {
					return err
				}
				perM := float64(g.rows) / 1e6
				row.heapMB, row.idxMB = float64(heap)/(1<<20)/perM, float64(idx)/(1<<20)/perM
			}
			wal[g] = row
		}
	}

	t := Table{
		Title:  "2. growth: claim latency (acquire + BEGIN + claim, one round trip) by processed-table size",
		Header: []string{"ids", "rows", "claim p50 µs", "claim p99 µs", "p50 × empty", "p99 × empty", "WAL B/claim", "FPI/claim", "next: WAL B", "next: FPI", "WAL B/dup", "heap MB/M rows", "index MB/M rows"},
	}
	for _, g := range tables {
		base := first(g.version)
		w, hasWAL := wal[g]
		cells := []string{"-", "-", "-", "-", "-", "-", "-"}
		if hasWAL {
			cells = []string{f0(w.bytes), f3(w.fpi), f0(w.nextBytes), f3(w.nextFPI), f0(w.dupBytes), "-", "-"}
			if g.rows > 0 {
				cells[5], cells[6] = f1(w.heapMB), f1(w.idxMB)
			}
		}
		t.Rows = append(t.Rows, append([]string{
			g.version, rowsLabel(g.rows),
			f0(medUS(g, func(s sample) time.Duration { return s.p50 })),
			f0(medUS(g, func(s sample) time.Duration { return s.p99 })),
			f3(perRound(g, base, p50r)), f3(perRound(g, base, p99r)),
		}, cells...))
	}
	note := "WAL: EXPLAIN (ANALYZE, WAL) of %d sequential claims, each in its own transaction (the claim's own records; the commit record is the handler's anyway)"
	if checkpoint {
		note += ", right after a CHECKPOINT (full-page images of every page first touched are counted: the worst case); next: the %[1]d claims after those"
	} else {
		note += "; next: the %[1]d claims after those"
	}
	t.Notes = []string{
		fmt.Sprintf("%d workers, one-INSERT handler through the chain; %d rounds × %s per table; filled with INSERT … SELECT, indexes in place.", sz.Workers, sz.Rounds, sz.Dur),
		fmt.Sprintf(note+".", sz.WALClaims),
	}
	res.Tables = append(res.Tables, t)

	res.set("growth_p99_ratio_v7", perRound(last("v7"), first("v7"), p99r))
	res.set("growth_p99_ratio_v4", perRound(last("v4"), first("v4"), p99r))
	res.set("growth_p50_ratio_v7", perRound(last("v7"), first("v7"), p50r))
	res.set("growth_p50_ratio_v4", perRound(last("v4"), first("v4"), p50r))
	res.set("growth_rows", float64(last("v7").rows))
	res.set("wal_bytes_per_claim_v7", wal[last("v7")].bytes)
	res.set("wal_bytes_per_claim_v4", wal[last("v4")].bytes)
	res.set("wal_bytes_per_claim_v7_next", wal[last("v7")].nextBytes)
	res.set("wal_bytes_per_claim_v4_next", wal[last("v4")].nextBytes)
	res.set("wal_bytes_per_duplicate", wal[last("v7")].dupBytes)
	if last("v7").rows > 0 {
		res.set("table_mb_per_million_rows", wal[last("v7")].heapMB)
		res.set("index_mb_per_million_rows_v7", wal[last("v7")].idxMB)
		res.set("index_mb_per_million_rows_v4", wal[last("v4")].idxMB)
	}
	return nil
}

func fill(ctx context.Context, e *env, pool *pgxpool.Pool, g *growthTable) error {
	if g.rows == 0 {
		return nil
	}
	table := g.store.Table().Quoted('"')
	start := time.Now()
	baseMS := time.Now().Add(-time.Duration(g.rows+60_000) * time.Millisecond).UnixMilli()
	for lo := 1; lo <= g.rows; lo += fillChunk {
		hi := min(lo+fillChunk-1, g.rows)
		var err error
		if g.version == "v7" {
			_, err = pool.Exec(ctx, fmt.Sprintf(fillV7, table), baseMS, lo, hi)
		} else {
			_, err = pool.Exec(ctx, fmt.Sprintf(fillV4, table), lo, hi)
		}
		if err != nil {
			return fmt.Errorf("bench: fill %s: %w", g.name(), err)
		}
		if g.rows > fillChunk {
			fmt.Fprintf(e.log, "growth: fill %s: %d/%d rows (%s)\n", g.name(), hi, g.rows, time.Since(start).Round(time.Second))
		}
	}
	return nil
}

// walPerClaim runs n claims of new ids (each in its own transaction) under
// EXPLAIN (ANALYZE, WAL) and returns the WAL bytes and full-page images per
// claim, and the WAL bytes of one duplicate claim.
func walPerClaim(ctx context.Context, pool *pgxpool.Pool, store *processedstore.Store, ver string, n int) (bytes, fpi, dupBytes float64, err error) {
	one := func(id uuid.UUID) (b, f float64, err error) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return 0, 0, err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		claim, args := store.ClaimQuery(consumerName, id)
		var out string
		if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, WAL, FORMAT JSON) "+claim, args...).Scan(&out); err != nil {
			return 0, 0, err
		}
		var plan []struct {
			Plan struct {
				WALBytes float64 `json:"WAL Bytes"`
				WALFPI   float64 `json:"WAL FPI"`
			}
		}
		if err := json.Unmarshal([]byte(out), &plan); err != nil || len(plan) != 1 {
			return 0, 0, fmt.Errorf("bench: EXPLAIN output %q: %v", out, err)
		}
		return plan[0].Plan.WALBytes, plan[0].Plan.WALFPI, tx.Commit(ctx)
	}
	var last uuid.UUID
	for i := 0; i < n; i++ {
		id := uuid.New()
		if ver == "v7" {
			if id, err = uuid.NewV7(); err != nil {
				return 0, 0, 0, err
			}
		}
		b, f, err := one(id)
		if err != nil {
			return 0, 0, 0, fmt.Errorf("bench: WAL of a claim: %w", err)
		}
		bytes += b
		fpi += f
		last = id
	}
	d, _, err := one(last)
	if err != nil {
		return 0, 0, 0, err
	}
	return bytes / float64(n), fpi / float64(n), d, nil
}
