package bench

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// experiments is not part of a normal run (-parts experiments): it measures,
// interleaved like part 1, configurations of the middleware and of the
// processed table that could lower the claim's cost, each against none:
//
//   - idempotent: the default (BEGIN + lock_timeout + claim pipelined).
//   - no_lock_timeout: Config.LockTimeout < 0 (no SET LOCAL in the batch).
//   - no_event_at_idx: the processed table without its partial event_at
//     btree (migration 7; purge would then need another access path).
//   - brin_processed_at: that index (event_at) as BRIN instead of btree.
func experiments(ctx context.Context, e *env, sz OverheadSizes, res *Result) error {
	schema, err := e.schema(ctx, "exp")
	if err != nil {
		return err
	}
	w := HeadlineWorkers
	pool, err := e.pool(ctx, schema, w+1)
	if err != nil {
		return err
	}
	defer e.closePool(pool)
	if _, err := pool.Exec(ctx, handlerSchema); err != nil {
		return err
	}
	mk := func(table string, mod func(*inbox.Config)) (message.HandlerFunc, *processedstore.Store, error) {
		store, err := e.store(ctx, pool, schema, table)
		if err != nil {
			return nil, nil, err
		}
		beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
		if err != nil {
			return nil, nil, err
		}
		cfg := inbox.Config{
			Beginner: beginner,
			Store:    store,
			Consumer: consumerName,
		}
		if mod != nil {
			mod(&cfg)
		}
		idem, err := inbox.NewIdempotent(cfg, watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		chain, _, err := chainWith(idem)
		if err != nil {
			return nil, nil, err
		}
		return compose(handler(h1), chain...), store, nil
	}
	hOurs, store, err := mk("processed_event", nil)
	if err != nil {
		return err
	}
	hNoLT, _, err := mk("processed_event", func(c *inbox.Config) { c.LockTimeout = -1 })
	if err != nil {
		return err
	}
	hNoIdx, s2, err := mk("processed_noidx", nil)
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, "DROP INDEX "+schema+"."+s2.Table().Name()+"_event_at_set_idx"); err != nil {
		return err
	}
	hBrin, s3, err := mk("processed_brin", nil)
	if err != nil {
		return err
	}
	idx := schema + "." + s3.Table().Name() + "_event_at_set_idx"
	if _, err := pool.Exec(ctx, "DROP INDEX "+idx+"; CREATE INDEX "+s3.Table().Name()+"_event_at_set_idx ON "+s3.Table().Quoted('"')+" USING brin (event_at) WHERE event_at IS NOT NULL"); err != nil {
		return err
	}
	vs, err := newVariantSet(pool, store)
	if err != nil {
		return err
	}
	vars := []armed{
		{vNone, vs.handlerFor(vNone, handler(h1)), newV7},
		{vOurs, hOurs, newV7},
		{"no_lock_timeout", hNoLT, newV7},
		{"no_event_at_idx", hNoIdx, newV7},
		{"brin_processed_at", hBrin, newV7},
	}
	samples, err := interleave(ctx, e, "experiments", pool, vars, w, sz.Rounds, sz.Dur, sz.Warmup, sz.MinCount)
	if err != nil {
		return err
	}
	t := Table{
		Title:  "experiments: claim configurations (one-INSERT handler, " + strconv.Itoa(w) + " workers; ratios: median of per-round ratios)",
		Header: []string{"variant", "msg/s", "× none", "× idempotent", "CPU µs/msg", "of which DB", "CPU × none", "CPU × idempotent"},
	}
	for _, v := range vars {
		s := samples[v.name]
		t.Rows = append(t.Rows, []string{
			v.name, f0(medianOf(s, func(x roundSample) float64 { return x.rate })),
			f3(perRound(s, samples[vNone], rateRatio)), f3(perRound(s, samples[vOurs], rateRatio)),
			f0(medianOf(s, func(x roundSample) float64 { return x.cpu })),
			f0(medianOf(s, func(x roundSample) float64 { return x.cpuDB })),
			f3(perRound(s, samples[vNone], cpuRatio)), f3(perRound(s, samples[vOurs], cpuRatio)),
		})
		res.set("exp_"+v.name+"_ratio", perRound(s, samples[vNone], rateRatio))
		res.set("exp_"+v.name+"_cpu_cost_ratio", perRound(s, samples[vNone], cpuRatio))
	}
	t.Notes = []string{fmt.Sprintf("%d rounds × %s per variant.", sz.Rounds, sz.Dur.Round(time.Millisecond))}
	res.Tables = append(res.Tables, t)
	return nil
}
