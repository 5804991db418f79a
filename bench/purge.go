package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// fillExpired inserts n processed rows older than the purge horizon: UUIDv7
// ids and processed_at about two hours ago, in increasing order.
const fillExpired = `INSERT INTO %s (consumer, event_id, event_at)
SELECT 'bench', (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7' || substr(r, 16, 3) || '-' || substr(r, 20, 17))::uuid,
       now() - interval '2 hours' + i * interval '1 microsecond'
FROM (SELECT i, lpad(to_hex($1::bigint + i), 12, '0') AS h, gen_random_uuid()::text AS r
      FROM generate_series(1, $2::bigint) AS i) AS s`

// purge measures part 4: claims by Workers workers while the Purger
// deletes Rows expired rows (PurgeNow: advisory lock, batches of
// DefaultPurgeBatchSize), against the same load without the purge. Each
// round refills the rows, then runs both phases (order alternating). The
// p99 ratio is the median of per-round ratios; the worst claim is the
// maximum over all purge phases.
func purge(ctx context.Context, e *env, sz PurgeSizes, res *Result) error {
	schema, err := e.schema(ctx, "purge")
	if err != nil {
		return err
	}
	pool, err := e.pool(ctx, schema, sz.Workers+2)
	if err != nil {
		return err
	}
	defer e.closePool(pool)
	if _, err := pool.Exec(ctx, handlerSchema); err != nil {
		return err
	}
	store, err := e.store(ctx, pool, schema, "processed_event")
	if err != nil {
		return err
	}
	purger, err := processedstore.NewPurger(store, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
	if err != nil {
		return err
	}
	sink := &claimSink{}
	idem, err := newIdempotent(pool, store, true, sink)
	if err != nil {
		return err
	}
	chain, _, err := chainWith(idem)
	if err != nil {
		return err
	}
	h := compose(handler(h1), chain...)
	table := store.Table().Quoted('"')
	baseMS := time.Now().Add(-2*time.Hour - time.Duration(sz.Rows)*time.Millisecond).UnixMilli()

	if _, err := runLoad(ctx, load{h: h, gen: newV7, workers: sz.Workers, dur: sz.BaseDur / 4, minCount: sz.MinCount}, nil); err != nil {
		return err
	}
	var (
		ratios, worstRatios   []float64
		p99Base, p99Purge     []float64
		worstBase, worstPurge time.Duration
		rowsPerSec            []float64
		purgeDurs             []float64
	)
	for r := 0; r < sz.Rounds; r++ {
		fmt.Fprintf(e.log, "purge: round %d/%d: fill %d expired rows\n", r+1, sz.Rounds, sz.Rows)
		if _, err := pool.Exec(ctx, fmt.Sprintf(fillExpired, table), baseMS, sz.Rows); err != nil {
			return fmt.Errorf("bench: purge fill: %w", err)
		}
		// autovacuum may be off on the server; a real table would be
		// vacuumed and analysed between purges.
		if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+table); err != nil {
			return err
		}
		var base, during []time.Duration
		var deleted int64
		var purgeDur time.Duration
		phaseBase := func() error {
			sink.start()
			_, err := runLoad(ctx, load{h: h, gen: newV7, workers: sz.Workers, dur: sz.BaseDur, minCount: sz.MinCount}, nil)
			base = sink.stop()
			return err
		}
		phasePurge := func() error {
			var done = make(chan struct{})
			var perr error
			sink.start()
			go func() {
				defer close(done)
				t0 := time.Now()
				var ran bool
				deleted, ran, perr = purger.PurgeNow(ctx)
				purgeDur = time.Since(t0)
				if perr == nil && !ran {
					perr = fmt.Errorf("bench: purge did not run (lock held elsewhere)")
				}
			}()
			purged := func() bool {
				select {
				case <-done:
					return true
				default:
					return false
				}
			}
			_, err := runLoad(ctx, load{h: h, gen: newV7, workers: sz.Workers, minCount: sz.MinCount}, purged)
			<-done
			during = sink.stop()
			if err == nil {
				err = perr
			}
			return err
		}
		phases := []func() error{phaseBase, phasePurge}
		if r%2 == 1 {
			phases = []func() error{phasePurge, phaseBase}
		}
		for _, p := range phases {
			if err := p(); err != nil {
				return fmt.Errorf("bench: purge round %d: %w", r+1, err)
			}
		}
		if deleted < int64(sz.Rows) {
			return fmt.Errorf("bench: purge deleted %d of %d expired rows", deleted, sz.Rows)
		}
		pb, pd := percentile(base, 0.99), percentile(during, 0.99)
		ratios = append(ratios, ratio(float64(pd), float64(pb)))
		worstRatios = append(worstRatios, ratio(float64(maxDur(during)), float64(maxDur(base))))
		p99Base, p99Purge = append(p99Base, us(pb)), append(p99Purge, us(pd))
		worstBase, worstPurge = max(worstBase, maxDur(base)), max(worstPurge, maxDur(during))
		rowsPerSec = append(rowsPerSec, float64(deleted)/purgeDur.Seconds())
		purgeDurs = append(purgeDurs, purgeDur.Seconds())
		if _, err := pool.Exec(ctx, "VACUUM "+table); err != nil {
			return err
		}
	}
	t := Table{
		Title:  "4. purge under load (claim latency while the Purger deletes expired rows vs the same load without it)",
		Header: []string{"phase", "claim p99 µs", "worst claim ms", "purge rows/s", "purge s", "p99 × no purge", "worst × no purge"},
		Rows: [][]string{
			{"no purge", f0(median(p99Base)), f1(ms(worstBase)), "-", "-", "1.000", "1.000"},
			{"purging", f0(median(p99Purge)), f1(ms(worstPurge)), f0(median(rowsPerSec)), f1(median(purgeDurs)), f3(median(ratios)), f3(median(worstRatios))},
		},
		Notes: []string{
			fmt.Sprintf("%d rounds × %d expired rows, batches of %d, %d workers claiming (one-INSERT handler); p99: median over rounds; worst: max over rounds.",
				sz.Rounds, sz.Rows, processedstore.DefaultPurgeBatchSize, sz.Workers),
		},
	}
	res.Tables = append(res.Tables, t)
	res.set("purge_p99_ratio", median(ratios))
	res.set("purge_worst_ms", ms(worstPurge))
	res.set("purge_worst_ms_without", ms(worstBase))
	res.set("purge_rows_per_s", median(rowsPerSec))
	return nil
}
