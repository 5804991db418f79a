package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// consumerName is the fixed consumer of every claim the benchmarks make.
const consumerName = "bench"

// Variants: how the same transactional handler is protected (or not).
const (
	vNone        = "none"        // pgx pool.Begin, handler, Commit: no deduplication
	vOurs        = "idempotent"  // our middleware, BEGIN+lock_timeout+claim pipelined
	vUnpipelined = "unpipelined" // our middleware with PgxBeginnerConfig.DisablePipeline
	vNaive       = "naive"       // SELECT-then-INSERT claim in the handler's transaction
	vSeparate    = "separate_tx" // claim committed on its own, then the handler's transaction
	vInMemory    = "inmemory"    // Watermill's Deduplicator (map), then the handler's transaction
	vDuplicate   = "duplicate"   // our middleware, every message already processed
)

// Handlers: what the effect costs.
const (
	h1 = "1stmt" // INSERT INTO reservation
	h3 = "3stmt" // INSERT reservation, UPDATE stock, INSERT reservation_log
)

// handlerSchema is created in every schema whose handlers write effects.
const handlerSchema = `
CREATE TABLE reservation (
    id          bigserial   PRIMARY KEY,
    event_id    uuid        NOT NULL,
    sku         int         NOT NULL,
    qty         int         NOT NULL,
    reserved_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE stock (sku int PRIMARY KEY, reserved bigint NOT NULL DEFAULT 0);
INSERT INTO stock (sku) SELECT generate_series(0, 9999);
CREATE TABLE reservation_log (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text NOT NULL);
`

type benchTxKey struct{}

// txFrom returns the handler's transaction: ours (PgxTxFromContext) or the
// plain one of txMiddleware.
func txFrom(ctx context.Context) (pgx.Tx, bool) {
	if tx, ok := inbox.PgxTxFromContext(ctx); ok {
		return tx, true
	}
	tx, ok := ctx.Value(benchTxKey{}).(pgx.Tx)
	return tx, ok
}

type order struct {
	SKU int `json:"sku"`
	Qty int `json:"qty"`
}

// handler returns the benchmark handler: it decodes the payload and writes
// the effect in the transaction from the context.
func handler(kind string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, ok := txFrom(ctx)
		if !ok {
			return nil, errors.New("bench: handler without a transaction")
		}
		var o order
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO reservation (event_id, sku, qty) VALUES ($1, $2, $3)`, msg.UUID, o.SKU, o.Qty); err != nil {
			return nil, err
		}
		if kind == h1 {
			return nil, nil
		}
		if _, err := tx.Exec(ctx, `UPDATE stock SET reserved = reserved + $2 WHERE sku = $1`, o.SKU, o.Qty); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO reservation_log (event_id, note) VALUES ($1, 'reserved')`, msg.UUID); err != nil {
			return nil, err
		}
		return nil, nil
	}
}

func noopHandler(*message.Message) ([]*message.Message, error) { return nil, nil }

// txMiddleware is what a handler without deduplication runs in: pgx's own
// transaction (pool.Begin: one round trip), committed after the handler.
func txMiddleware(pool *pgxpool.Pool) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			msg.SetContext(context.WithValue(ctx, benchTxKey{}, tx))
			defer msg.SetContext(ctx)
			out, err := h(msg)
			if err != nil {
				_ = tx.Rollback(ctx)
				return nil, err
			}
			if err := tx.Commit(ctx); err != nil {
				return nil, err
			}
			return out, nil
		}
	}
}

// naiveClaim runs inside txMiddleware: SELECT whether the event was
// processed, then a plain INSERT (a concurrent duplicate would abort the
// transaction with 23505; the benchmark sends none).
func naiveClaim(store *processedstore.Store) message.HandlerMiddleware {
	table := store.Table().Quoted('"')
	sel := `SELECT EXISTS (SELECT 1 FROM ` + table + ` WHERE consumer = $1 AND event_id = $2)`
	ins := `INSERT INTO ` + table + ` (consumer, event_id) VALUES ($1, $2)`
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, _ := txFrom(ctx)
			id, err := uuid.Parse(msg.UUID)
			if err != nil {
				return nil, err
			}
			var seen bool
			if err := tx.QueryRow(ctx, sel, consumerName, idArg(id)).Scan(&seen); err != nil {
				return nil, err
			}
			if seen {
				return nil, nil
			}
			if _, err := tx.Exec(ctx, ins, consumerName, idArg(id)); err != nil {
				return nil, err
			}
			return h(msg)
		}
	}
}

// separateClaim claims in a transaction of its own (autocommit on the pool)
// before the handler's transaction: two commits per message, and a failure
// after the first loses the event.
func separateClaim(pool *pgxpool.Pool, store *processedstore.Store) message.HandlerMiddleware {
	q := sqldb.Pgx(pool)
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			id, err := uuid.Parse(msg.UUID)
			if err != nil {
				return nil, err
			}
			ok, err := store.Claim(msg.Context(), q, consumerName, id)
			if err != nil || !ok {
				return nil, err
			}
			return h(msg)
		}
	}
}

// inMemory is Watermill's Deduplicator keyed by the event id, with its map
// repository: fast, not durable, and it keeps the key of a failed message.
func inMemory() (message.HandlerMiddleware, error) {
	repo, err := wmw.NewMapExpiringKeyRepository(10 * time.Minute)
	if err != nil {
		return nil, err
	}
	d := &wmw.Deduplicator{
		KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
		Repository: repo,
		Timeout:    time.Minute,
	}
	return d.Middleware, nil
}

// discard is the poison publisher of the chains (nothing is poisoned here).
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }

func newIdempotent(pool *pgxpool.Pool, store *processedstore.Store, pipelined bool, rec inbox.Recorder) (*inbox.Idempotent, error) {
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{DisablePipeline: !pipelined})
	if err != nil {
		return nil, err
	}
	cfg := inbox.Config{
		Beginner: beginner,
		Store:    store,
		Consumer: consumerName,
		// As NewConsumer sets it: the crash count's querier, which also
		// reads the duplicates of a run of duplicates (MaxCrashes stays
		// 0 here; the crash bound's variants are counted apart).
		CrashQuerier: inbox.OwnQuerier(beginner, sqldb.PgxIn(pool, sqldb.OwnMode(pool))),
	}
	if rec != nil {
		cfg.Recorder = rec
	}
	return inbox.NewIdempotent(cfg, watermill.NopLogger{})
}

// chainWith returns the recommended chain (middleware.NewConsumer) of idem:
// Poison → Retry → Recoverer → idem, and the same three outer middlewares
// for the other variants, so that every variant pays the same chain.
func chainWith(idem *inbox.Idempotent) (ours, outer []message.HandlerMiddleware, err error) {
	ours, err = inbox.NewChain(inbox.ChainConfig{
		Idempotent:      idem,
		PoisonPublisher: discard{},
		PoisonTopic:     "bench_poison",
	}, watermill.NopLogger{})
	if err != nil {
		return nil, nil, err
	}
	if len(ours) < 2 {
		return nil, nil, fmt.Errorf("bench: unexpected chain of %d middlewares", len(ours))
	}
	return ours, ours[: len(ours)-1 : len(ours)-1], nil
}

// compose applies mws to h, the first outermost (as Router.AddMiddleware).
func compose(h message.HandlerFunc, mws ...message.HandlerMiddleware) message.HandlerFunc {
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// variantSet builds every variant's full handler for one pool and store.
type variantSet struct {
	pool  *pgxpool.Pool
	store *processedstore.Store
	sink  *claimSink

	// dup is ours fed only duplicates, a middleware of its own: the
	// share of duplicates it keeps (a run of duplicates, inbox
	// duplicaterun.go) is not ours's.
	ours, dup, unpipelined *inbox.Idempotent
	chainOurs, chainDup    []message.HandlerMiddleware
	chainUnpiped           []message.HandlerMiddleware
	outer                  []message.HandlerMiddleware
	inmem                  message.HandlerMiddleware
}

func newVariantSet(pool *pgxpool.Pool, store *processedstore.Store) (*variantSet, error) {
	vs := &variantSet{pool: pool, store: store, sink: &claimSink{}}
	var err error
	if vs.ours, err = newIdempotent(pool, store, true, vs.sink); err != nil {
		return nil, err
	}
	if vs.dup, err = newIdempotent(pool, store, true, nil); err != nil {
		return nil, err
	}
	if vs.chainDup, _, err = chainWith(vs.dup); err != nil {
		return nil, err
	}
	if vs.unpipelined, err = newIdempotent(pool, store, false, nil); err != nil {
		return nil, err
	}
	if vs.chainOurs, vs.outer, err = chainWith(vs.ours); err != nil {
		return nil, err
	}
	if vs.chainUnpiped, _, err = chainWith(vs.unpipelined); err != nil {
		return nil, err
	}
	if vs.inmem, err = inMemory(); err != nil {
		return nil, err
	}
	return vs, nil
}

// handlerFor returns variant v around handler h, inside the recommended chain.
func (vs *variantSet) handlerFor(v string, h message.HandlerFunc) message.HandlerFunc {
	tx := txMiddleware(vs.pool)
	outer := vs.outer
	switch v {
	case vOurs:
		return compose(h, vs.chainOurs...)
	case vDuplicate:
		return compose(h, vs.chainDup...)
	case vUnpipelined:
		return compose(h, vs.chainUnpiped...)
	case vNaive:
		return compose(h, append(append([]message.HandlerMiddleware{}, outer...), tx, naiveClaim(vs.store))...)
	case vSeparate:
		return compose(h, append(append([]message.HandlerMiddleware{}, outer...), separateClaim(vs.pool, vs.store), tx)...)
	case vInMemory:
		return compose(h, append(append([]message.HandlerMiddleware{}, outer...), vs.inmem, tx)...)
	case vFloorMechanism:
		return compose(h, append(append([]message.HandlerMiddleware{}, outer...), mechanismClaim(vs.pool))...)
	default: // vNone
		return compose(h, append(append([]message.HandlerMiddleware{}, outer...), tx)...)
	}
}

// innerFor returns variant v around h without the recommended chain's
// outer middlewares (Poison, Retry, Recoverer): every variant alone, so that
// the Go benchmarks compare like with like.
func (vs *variantSet) innerFor(v string, h message.HandlerFunc) message.HandlerFunc {
	tx := txMiddleware(vs.pool)
	switch v {
	case vOurs:
		return vs.ours.Middleware(h)
	case vDuplicate:
		return vs.dup.Middleware(h)
	case vUnpipelined:
		return vs.unpipelined.Middleware(h)
	case vNaive:
		return compose(h, tx, naiveClaim(vs.store))
	case vSeparate:
		return compose(h, separateClaim(vs.pool, vs.store), tx)
	case vInMemory:
		return compose(h, vs.inmem, tx)
	default: // vNone
		return tx(h)
	}
}

// idArg encodes an event id as the claim statement binds it (PostgreSQL uuid).
func idArg(id uuid.UUID) any { return pgtype.UUID{Bytes: id, Valid: true} }

// Message generators.

func payload() json.RawMessage {
	return json.RawMessage(fmt.Sprintf(`{"sku":%d,"qty":1}`, rand.IntN(10000)))
}

const eventName = "stock.reserve"

// newV7 is a new event (UUIDv7 id), as producers make them.
func newV7() (*message.Message, error) { return marshaler.NewMessage(eventName, payload()) }

// newV4 is a new event with a random (v4) id, for the growth contrast.
func newV4() (*message.Message, error) {
	return marshaler.NewMessageWithID(uuid.New(), eventName, time.Now().UTC(), payload())
}

// cycle returns a generator of messages whose ids cycle through ids
// (already processed: duplicates).
func cycle(ids []uuid.UUID) func() (*message.Message, error) {
	var i atomic.Int64
	return func() (*message.Message, error) {
		n := i.Add(1) - 1
		return marshaler.NewMessageWithID(ids[int(n%int64(len(ids)))], eventName, time.Now().UTC(), payload())
	}
}

// preclaim records n new UUIDv7 ids as processed by consumerName in store's
// table (COPY), and returns them.
func preclaim(ctx context.Context, pool *pgxpool.Pool, store *processedstore.Store, n int) ([]uuid.UUID, error) {
	ids := make([]uuid.UUID, n)
	rows := make([][]any, n)
	for i := range ids {
		id, err := uuid.NewV7()
		if err != nil {
			return nil, err
		}
		ids[i] = id
		rows[i] = []any{consumerName, idArg(id)}
	}
	t := store.Table()
	ident := pgx.Identifier{t.Name()}
	if s := t.String(); s != t.Name() {
		ident = pgx.Identifier{s[:len(s)-len(t.Name())-1], t.Name()}
	}
	if _, err := pool.CopyFrom(ctx, ident, []string{"consumer", "event_id"}, pgx.CopyFromRows(rows)); err != nil {
		return nil, fmt.Errorf("bench: preclaim: %w", err)
	}
	return ids, nil
}

// load drives h with workers goroutines for at least dur and at least
// minCount messages, each a fresh message of gen.
type load struct {
	h        message.HandlerFunc
	gen      func() (*message.Message, error)
	workers  int
	dur      time.Duration
	minCount int
}

type loadResult struct {
	n       int
	elapsed time.Duration
	lat     []time.Duration // whole-message latency (chain call)
}

func (r loadResult) rate() float64 {
	if r.elapsed <= 0 {
		return 0
	}
	return float64(r.n) / r.elapsed.Seconds()
}

// runLoad stops early, with the first error, if a message fails or while
// `until` (when set) reports false it keeps going past dur.
func runLoad(ctx context.Context, l load, until func() bool) (loadResult, error) {
	var (
		total    atomic.Int64
		mu       sync.Mutex
		firstErr error
		lats     = make([][]time.Duration, l.workers)
		wg       sync.WaitGroup
		stop     atomic.Bool
	)
	start := time.Now()
	for w := 0; w < l.workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			mine := make([]time.Duration, 0, 1024)
			for !stop.Load() {
				if ctx.Err() != nil {
					break
				}
				if time.Since(start) >= l.dur && total.Load() >= int64(l.minCount) && (until == nil || until()) {
					break
				}
				msg, err := l.gen()
				if err == nil {
					msg.SetContext(ctx)
					t0 := time.Now()
					_, err = l.h(msg)
					mine = append(mine, time.Since(t0))
				}
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					stop.Store(true)
					break
				}
				total.Add(1)
			}
			lats[w] = mine
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	return loadResult{n: int(total.Load()), elapsed: elapsed, lat: all}, firstErr
}

// rotate returns xs rotated left by k (the round's variant order).
func rotate[T any](xs []T, k int) []T {
	if len(xs) == 0 {
		return nil
	}
	k %= len(xs)
	return append(append([]T{}, xs[k:]...), xs[:k]...)
}

// armed is one variant of an interleaved comparison.
type armed struct {
	name string
	h    message.HandlerFunc
	gen  func() (*message.Message, error)
}

type roundSample struct {
	rate     float64
	p50, p99 time.Duration
	cpu      float64 // CPU µs per message, this process + the pool's backends; NaN if unknown
	cpuDB    float64 // the backends' share of cpu
}

// interleave warms every variant up, then runs rounds: in each, every
// variant once for dur (order rotated by the round number), on workers
// goroutines. It returns each variant's per-round samples, index-aligned.
func interleave(ctx context.Context, e *env, label string, pool *pgxpool.Pool, vars []armed, workers, rounds int, dur, warmup time.Duration, minCount int) (map[string][]roundSample, error) {
	for _, v := range vars {
		if _, err := runLoad(ctx, load{h: v.h, gen: v.gen, workers: workers, dur: warmup, minCount: minCount}, nil); err != nil {
			return nil, fmt.Errorf("bench: %s %s: %w", label, v.name, err)
		}
	}
	meter := newCPUMeter(ctx, pool)
	out := map[string][]roundSample{}
	for r := 0; r < rounds; r++ {
		fmt.Fprintf(e.log, "%s: round %d/%d\n", label, r+1, rounds)
		for _, v := range rotate(vars, r) {
			s0, c0, ok0 := meter.read()
			lr, err := runLoad(ctx, load{h: v.h, gen: v.gen, workers: workers, dur: dur, minCount: minCount}, nil)
			if err != nil {
				return nil, fmt.Errorf("bench: %s %s: %w", label, v.name, err)
			}
			s1, c1, ok1 := meter.read()
			cpu, cpuDB := math.NaN(), math.NaN()
			if ok0 && ok1 && lr.n > 0 {
				cpu = us(s1-s0+c1-c0) / float64(lr.n)
				cpuDB = us(s1-s0) / float64(lr.n)
			}
			out[v.name] = append(out[v.name], roundSample{rate: lr.rate(), p50: percentile(lr.lat, 0.5), p99: percentile(lr.lat, 0.99), cpu: cpu, cpuDB: cpuDB})
		}
	}
	return out, nil
}

// perRound is the median over rounds of f(a's sample, b's sample).
func perRound(a, b []roundSample, f func(x, y roundSample) float64) float64 {
	return median(perRoundXs(a, b, f))
}

// perRoundXs is f(a's sample, b's sample) of every round (NaN skipped).
func perRoundXs(a, b []roundSample, f func(x, y roundSample) float64) []float64 {
	var xs []float64
	for i := 0; i < len(a) && i < len(b); i++ {
		if v := f(a[i], b[i]); !math.IsNaN(v) {
			xs = append(xs, v)
		}
	}
	return xs
}

func rateRatio(a, b roundSample) float64 { return ratio(a.rate, b.rate) }
func p50Ratio(a, b roundSample) float64  { return ratio(float64(a.p50), float64(b.p50)) }
func p99Ratio(a, b roundSample) float64  { return ratio(float64(a.p99), float64(b.p99)) }
func cpuRatio(a, b roundSample) float64  { return ratio(a.cpu, b.cpu) }

// medianOf is the median over rounds of f(sample).
func medianOf(s []roundSample, f func(roundSample) float64) float64 {
	var xs []float64
	for _, x := range s {
		if v := f(x); !math.IsNaN(v) {
			xs = append(xs, v)
		}
	}
	return median(xs)
}
