package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// The quick command's code path, on tiny sizes: every part runs and the last
// line of the output is one JSON object with every required key, finite.
// The benchmarks themselves are not run in CI (too long); this keeps them
// from rotting.
func TestQuickCodePathTiny(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var log bytes.Buffer
	res, err := Run(ctx, Options{Sizes: Tiny, Log: &log, Parts: append(append([]string{}, Parts...), "experiments")})
	require.NoError(t, err, "progress:\n%s", log.String())

	var out bytes.Buffer
	res.Print(&out)
	lines := strings.Split(strings.TrimRight(out.String(), "\n"), "\n")
	last := lines[len(lines)-1]
	var got map[string]any
	require.NoError(t, json.Unmarshal([]byte(last), &got), "last line is not one JSON object: %s", last)
	for _, k := range RequiredKeys {
		v, ok := got[k]
		require.True(t, ok, "key %s missing from %s", k, last)
		f, ok := v.(float64)
		require.True(t, ok, "key %s is not a number (%v) in %s", k, v, last)
		require.False(t, math.IsNaN(f) || math.IsInf(f, 0), "key %s is not finite", k)
	}
	for _, k := range []string{"server_instructions_per_claim", "client_instructions_per_claim", "wal_bytes_per_claim", "client_instructions_per_msg", "allocs_per_msg_plain"} {
		_, ok := got[k] // null in the tiny profile (no valgrind run)
		require.True(t, ok, "key %s missing from %s", k, last)
	}
	// The JetStream half of part 3 ran, and every headline ratio carries its
	// spread over the rounds.
	for _, k := range []string{"e2e_ratio_jetstream", "e2e_dup30_ratio_jetstream", "inmemory_overhead_ratio"} {
		f, ok := got[k].(float64)
		require.True(t, ok, "key %s is not a number in %s", k, last)
		require.False(t, math.IsNaN(f) || math.IsInf(f, 0), "key %s is not finite", k)
	}
	for _, k := range []string{"claim_overhead_ratio", "claim_overhead_ratio_3stmt", "e2e_ratio", "e2e_ratio_jetstream"} {
		for _, suffix := range []string{"_min", "_max", "_iqr"} {
			_, ok := got[k+suffix].(float64)
			require.True(t, ok, "key %s%s missing or not a number in %s", k, suffix, last)
		}
		require.LessOrEqual(t, got[k+"_min"].(float64), got[k].(float64))
		require.GreaterOrEqual(t, got[k+"_max"].(float64), got[k].(float64))
	}
	require.Contains(t, out.String(), "-- 3b. end to end over NATS JetStream")
	require.Contains(t, out.String(), "-- targets (issue 25")
	md := res.TargetsMarkdown()
	for _, tg := range targets25 {
		require.Contains(t, md, "`"+tg.key+"`")
	}
	require.Contains(t, md, "the mechanism alone (floor_mechanism: a uuid-only INSERT … ON CONFLICT DO NOTHING sent with BEGIN) ")
	require.Contains(t, out.String(), "-- 1. claim overhead")
	require.Contains(t, out.String(), "-- 5. memory")
	require.Contains(t, out.String(), "-- experiments")
}

func TestPercentileAndMedian(t *testing.T) {
	t.Parallel()
	d := []time.Duration{5, 1, 4, 2, 3, 6, 7, 8, 9, 10}
	require.Equal(t, time.Duration(5), percentile(d, 0.5))
	require.Equal(t, time.Duration(10), percentile(d, 0.99))
	require.Equal(t, time.Duration(1), percentile(d, 0.01))
	require.Equal(t, time.Duration(0), percentile(nil, 0.5))
	require.Equal(t, 2.5, median([]float64{4, 1, 2, 3}))
	require.Equal(t, 3.0, median([]float64{3, 1, 5}))
	require.True(t, math.IsNaN(median(nil)))
	require.Equal(t, []int{3, 1, 2}, rotate([]int{1, 2, 3}, 2))
}

func TestSpreadOf(t *testing.T) {
	t.Parallel()
	sp := spreadOf([]float64{0.9, 0.8, 1.0, 0.95, 0.85, 0.7, 0.92, 0.88})
	require.Equal(t, 8, sp.n)
	require.Equal(t, 0.7, sp.min)
	require.Equal(t, 1.0, sp.max)
	require.Equal(t, 0.8, sp.q1)  // 2nd of 8 sorted
	require.Equal(t, 0.92, sp.q3) // 6th of 8 sorted
	require.InDelta(t, 0.89, sp.med, 1e-9)
	require.Equal(t, "0.700–1.000 (IQR 0.800–0.920, 8 rounds)", sp.String())
	require.Equal(t, "-", spreadOf(nil).String())

	r := &Result{Profile: "x"}
	r.setRatio("claim_overhead_ratio", []float64{0.9, 0.8, 1.0})
	r.setRatio("inmemory_overhead_ratio", []float64{0.97, 0.99})
	r.setRatio("floor_mechanism_overhead_ratio", []float64{0.91, 0.93})
	var got map[string]any
	require.NoError(t, json.Unmarshal(r.JSON(), &got))
	require.Equal(t, 0.9, got["claim_overhead_ratio"])
	require.Equal(t, 0.8, got["claim_overhead_ratio_min"])
	require.Equal(t, 1.0, got["claim_overhead_ratio_max"])
	require.InDelta(t, 0.2, got["claim_overhead_ratio_iqr"], 1e-9)
	md := r.TargetsMarkdown()
	require.Contains(t, md, "| claim, one-INSERT handler (rate ÷ no dedup, 4 workers) | `claim_overhead_ratio` | 0.900 | 0.800–1.000 (IQR 0.800–1.000, 3 rounds) | ≥ 0.9 | yes | the mechanism alone (floor_mechanism: a uuid-only INSERT … ON CONFLICT DO NOTHING sent with BEGIN) 0.920 (0.910–0.930), in-memory Deduplicator 0.980 (0.970–0.990) (this run) |")
	require.Contains(t, md, "| `e2e_ratio_jetstream` | - | - | ≥ 0.93 | n/a | - |")
	require.Contains(t, md, "| `server_instructions_per_claim` | - | - | ≤ 65k | n/a | 50.4k the mechanism alone")
	require.Contains(t, md, "| `client_instructions_per_claim` | - | - | ≤ 8k | n/a | - |")
}

func TestJSONNullsNonFinite(t *testing.T) {
	t.Parallel()
	r := &Result{Profile: "x"}
	r.set("claim_overhead_ratio", 0.91234)
	r.set("vs_naive_ratio", math.NaN())
	r.set("extra", 3)
	var got map[string]any
	require.NoError(t, json.Unmarshal(r.JSON(), &got))
	require.Equal(t, 0.9123, got["claim_overhead_ratio"])
	require.Nil(t, got["vs_naive_ratio"])
	require.Nil(t, got["e2e_ratio"])
	require.Equal(t, 3.0, got["extra"])
}

// Go benchmarks of one message through each variant (no broker), with
// allocations: go test -run '^$' -bench . -benchmem ./bench
//
// They measure one variant at a time; for ratios use the command, which
// interleaves the variants. Like with like: "noop/<variant>" is each
// variant's own middleware alone around a no-op handler (no chain: none is
// pgx's Begin/Commit, idempotent our middleware), "1stmt/<variant>" the
// one-INSERT handler through the recommended chain for every variant.
func BenchmarkVariants(b *testing.B) {
	ctx := context.Background()
	vs, dups := benchSetup(b, 2)
	for _, hk := range []string{"noop", h1} {
		for _, v := range variants1 {
			b.Run(hk+"/"+v, func(b *testing.B) {
				var full message.HandlerFunc
				if hk == "noop" {
					full = vs.innerFor(v, noopHandler) // the variant alone, no chain
				} else {
					full = vs.handlerFor(v, handler(hk)) // through the chain
				}
				gen := newV7
				if v == vDuplicate {
					gen = cycle(dups)
				}
				msgs := make([]*message.Message, b.N)
				for i := range msgs {
					var err error
					if msgs[i], err = gen(); err != nil {
						b.Fatal(err)
					}
					msgs[i].SetContext(ctx)
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if _, err := full(msgs[i]); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkVariantsParallel: HeadlineWorkers goroutines (whatever
// GOMAXPROCS), one-INSERT handler through the chain; for profiling one
// variant at a time (-bench 'Parallel/idempotent$' -cpuprofile …).
func BenchmarkVariantsParallel(b *testing.B) {
	ctx := context.Background()
	vs, dups := benchSetup(b, HeadlineWorkers+1)
	for _, v := range variants1 {
		b.Run(v, func(b *testing.B) {
			full := vs.handlerFor(v, handler(h1))
			gen := newV7
			if v == vDuplicate {
				gen = cycle(dups)
			}
			b.ReportAllocs()
			b.SetParallelism((HeadlineWorkers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					msg, err := gen()
					if err == nil {
						msg.SetContext(ctx)
						_, err = full(msg)
					}
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

func benchSetup(b *testing.B, conns int) (*variantSet, []uuid.UUID) {
	ctx := context.Background()
	e, err := newEnv(ctx, io.Discard)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(e.close)
	schema, err := e.schema(ctx, "gobench")
	if err != nil {
		b.Fatal(err)
	}
	pool, err := e.pool(ctx, schema, conns)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, handlerSchema+floorUUIDSchema); err != nil {
		b.Fatal(err)
	}
	store, err := e.store(ctx, pool, schema, "processed_event")
	if err != nil {
		b.Fatal(err)
	}
	vs, err := newVariantSet(pool, store)
	if err != nil {
		b.Fatal(err)
	}
	dups, err := preclaim(ctx, pool, store, 10000)
	if err != nil {
		b.Fatal(err)
	}
	return vs, dups
}

func TestWriteMarkdownKeepsNotes(t *testing.T) {
	t.Parallel()
	path := t.TempDir() + "/RESULTS.md"
	r := &Result{Profile: "full", Machine: [][2]string{{"cpus", "2"}}}
	r.set("claim_overhead_ratio", 0.9)
	require.NoError(t, r.WriteMarkdown(path, "go run ./bench/cmd/idembench", time.Minute, 2.5, 0.5))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Contains(t, string(b), "machine was loaded")
	require.Contains(t, string(b), `"claim_overhead_ratio":0.9`)
	require.NoError(t, os.WriteFile(path, append(b, []byte("\n## Notes\n\nkept\n")...), 0o644))
	require.NoError(t, r.WriteMarkdown(path, "go run ./bench/cmd/idembench", time.Minute, 0.5, 0.5))
	b, err = os.ReadFile(path)
	require.NoError(t, err)
	require.Contains(t, string(b), "## Notes\n\nkept\n")
	require.NotContains(t, string(b), "machine was loaded")
	require.Equal(t, 1, strings.Count(string(b), "## Notes"))
}
