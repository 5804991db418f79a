package bench

import (
	"context"
	"fmt"
	"slices"
	"strconv"
)

var variants1 = []string{vNone, vOurs, vFloorMechanism, vUnpipelined, vNaive, vSeparate, vInMemory, vDuplicate}

// overhead measures part 1: the same handler through the recommended chain,
// driven by N workers with no broker, under each variant. In every round
// each (handler, variant) runs once for Dur, in an order rotated per round;
// a ratio is the median over rounds of that round's variant ÷ none (same
// handler, same workers).
func overhead(ctx context.Context, e *env, sz OverheadSizes, res *Result) error {
	schema, err := e.schema(ctx, "overhead")
	if err != nil {
		return err
	}
	setup, err := e.pool(ctx, schema, 2)
	if err != nil {
		return err
	}
	defer e.closePool(setup)
	if _, err := setup.Exec(ctx, handlerSchema+floorUUIDSchema); err != nil {
		return err
	}
	store, err := e.store(ctx, setup, schema, "processed_event")
	if err != nil {
		return err
	}
	dupIDs, err := preclaim(ctx, setup, store, sz.DupIDs)
	if err != nil {
		return err
	}
	name := func(hk, v string) string { return hk + "/" + v }

	samples := map[int]map[string][]roundSample{}
	for _, w := range sz.Workers {
		// One pool per worker count, sized so that no variant waits for a
		// connection (separate_tx holds one at a time per worker too).
		pool, err := e.pool(ctx, schema, w+1)
		if err != nil {
			return err
		}
		vs, err := newVariantSet(pool, store)
		if err != nil {
			return err
		}
		var vars []armed
		add := func(hk, v string) {
			gen := newV7
			if v == vDuplicate {
				gen = cycle(dupIDs)
			}
			vars = append(vars, armed{name: name(hk, v), h: vs.handlerFor(v, handler(hk)), gen: gen})
		}
		for _, v := range variants1 {
			add(h1, v)
		}
		for _, v := range sz.Variants3 {
			add(h3, v)
		}
		s, err := interleave(ctx, e, fmt.Sprintf("overhead %d workers", w), pool, vars, w, sz.Rounds, sz.Dur, sz.Warmup, sz.MinCount)
		if err != nil {
			return err
		}
		samples[w] = s
		e.closePool(pool)
	}

	t := Table{
		Title:  "1. claim overhead, no broker (same handler through the recommended chain; ratios: median of per-round ratios to none)",
		Header: []string{"workers", "handler", "variant", "msg/s", "× none", "spread", "p50 µs", "p99 µs", "p50 × none", "p99 × none", "CPU µs/msg", "of which DB", "CPU × none"},
	}
	for _, w := range sz.Workers {
		for _, hk := range []string{h1, h3} {
			vars := variants1
			if hk == h3 {
				vars = sz.Variants3
			}
			base := samples[w][name(hk, vNone)]
			for _, v := range vars {
				s := samples[w][name(hk, v)]
				t.Rows = append(t.Rows, []string{
					strconv.Itoa(w), hk, v,
					f0(medianOf(s, func(x roundSample) float64 { return x.rate })),
					f3(perRound(s, base, rateRatio)),
					spreadText(v, perRoundXs(s, base, rateRatio)),
					f0(medianOf(s, func(x roundSample) float64 { return us(x.p50) })),
					f0(medianOf(s, func(x roundSample) float64 { return us(x.p99) })),
					f3(perRound(s, base, p50Ratio)),
					f3(perRound(s, base, p99Ratio)),
					f0(medianOf(s, func(x roundSample) float64 { return x.cpu })),
					f0(medianOf(s, func(x roundSample) float64 { return x.cpuDB })),
					f3(perRound(s, base, cpuRatio)),
				})
			}
		}
	}
	t.Notes = []string{
		"none: pgx pool.Begin + handler + Commit. idempotent: our middleware (BEGIN, lock_timeout and the claim in one pgx.Batch).",
		"unpipelined: ours with DisablePipeline (pgx BeginTx, then lock_timeout, then the claim). naive: SELECT then INSERT in the handler's tx.",
		"floor_mechanism: BEGIN and a uuid-only INSERT … ON CONFLICT DO NOTHING (prepared) in one batch, the handler, COMMIT: what any claim row costs.",
		"separate_tx: the claim committed alone, then the handler's tx. inmemory: Watermill Deduplicator (map, keyed by event id) + the handler's tx.",
		"duplicate: our middleware fed ids already processed (rate of duplicates; its ratio to idempotent is duplicate_speedup).",
		"× none is the median of the per-round rate ratios; spread: their min–max over the rounds.",
		fmt.Sprintf("%d rounds × %s per variant; latency is the whole chain call; CPU: this process + the pool's PostgreSQL backends (schedstat), per message.", sz.Rounds, sz.Dur),
	}
	res.Tables = append(res.Tables, t)

	hw := HeadlineWorkers
	if !containsInt(sz.Workers, hw) {
		hw = sz.Workers[len(sz.Workers)/2]
	}
	s := func(hk, v string) []roundSample { return samples[hw][name(hk, v)] }
	res.setRatio("claim_overhead_ratio", perRoundXs(s(h1, vOurs), s(h1, vNone), rateRatio))
	res.setRatio("claim_overhead_ratio_3stmt", perRoundXs(s(h3, vOurs), s(h3, vNone), rateRatio))
	res.setRatio("inmemory_overhead_ratio", perRoundXs(s(h1, vInMemory), s(h1, vNone), rateRatio))
	res.setRatio("floor_mechanism_overhead_ratio", perRoundXs(s(h1, vFloorMechanism), s(h1, vNone), rateRatio))
	res.set("floor_mechanism_cpu_cost_ratio", perRound(s(h1, vFloorMechanism), s(h1, vNone), cpuRatio))
	if slices.Contains(sz.Variants3, vFloorMechanism) {
		res.setRatio("floor_mechanism_overhead_ratio_3stmt", perRoundXs(s(h3, vFloorMechanism), s(h3, vNone), rateRatio))
	}
	if slices.Contains(sz.Variants3, vInMemory) {
		res.setRatio("inmemory_overhead_ratio_3stmt", perRoundXs(s(h3, vInMemory), s(h3, vNone), rateRatio))
	}
	res.set("vs_naive_ratio", perRound(s(h1, vOurs), s(h1, vNaive), rateRatio))
	res.set("vs_separate_tx_ratio", perRound(s(h1, vOurs), s(h1, vSeparate), rateRatio))
	res.set("vs_inmemory_ratio", perRound(s(h1, vOurs), s(h1, vInMemory), rateRatio))
	res.set("duplicate_speedup", perRound(s(h1, vDuplicate), s(h1, vOurs), rateRatio))
	res.set("unpipelined_overhead_ratio", perRound(s(h1, vUnpipelined), s(h1, vNone), rateRatio))
	res.set("claim_p50_ratio", perRound(s(h1, vOurs), s(h1, vNone), p50Ratio))
	res.set("claim_p99_ratio", perRound(s(h1, vOurs), s(h1, vNone), p99Ratio))
	res.set("claim_cpu_cost_ratio", perRound(s(h1, vOurs), s(h1, vNone), cpuRatio))
	res.set("claim_cpu_cost_ratio_3stmt", perRound(s(h3, vOurs), s(h3, vNone), cpuRatio))
	res.set("none_msg_per_s", medianOf(s(h1, vNone), func(x roundSample) float64 { return x.rate }))
	res.set("idempotent_msg_per_s", medianOf(s(h1, vOurs), func(x roundSample) float64 { return x.rate }))
	res.set("duplicate_msg_per_s", medianOf(s(h1, vDuplicate), func(x roundSample) float64 { return x.rate }))
	return nil
}

// spreadText is the min–max of a variant's per-round ratios, "-" for none
// (the baseline, 1 in every round).
func spreadText(variant string, xs []float64) string {
	if variant == vNone {
		return "-"
	}
	return spreadOf(xs).short()
}

func containsInt(xs []int, x int) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
