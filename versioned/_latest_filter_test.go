package versioned_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

// TestLatestPerFamilyDropsSupersededEvents (case C15): latest per family.
// Family (customer.status, c-1), published and delivered in this order: F1
// 10:00:00.000 active; F2 10:00:02 suspended; F3 10:00:01.000 closed; F4
// 10:00:02.000 (the same instant as F2, written with fractional seconds, a
// larger event_id) reactivated. F3 is obsolete (acked, handler not called,
// its redelivery too); the F2/F4 tie is broken by event_id, so F4 wins;
// another family is untouched. Run for both latest stores (the SQL family
// store, Redis), on every target: PostgreSQL through both drivers of the
// idempotent middleware, MariaDB, SQLite.
func TestLatestPerFamilyDropsSupersededEvents(t *testing.T) {
	t.Parallel()
	for _, store := range lfStores {
		for _, drv := range testenv.TargetNames {
			t.Run(store+"/"+drv, func(t *testing.T) {
				t.Parallel()
				exerciseC15(t, newLFEnvWith(t, store, drv))
			})
		}
	}
}

func exerciseC15(t *testing.T, e *lfEnv) {
	c1 := versioned.Family{Kind: "customer.status", ID: "c-1"}
	c2 := versioned.Family{Kind: "customer.status", ID: "c-2"}
	// "10:00:02Z" and "10:00:02.000Z": the same instant. Compared as text,
	// "…02Z" > "…02.000Z" ('Z' > '.') and F2 would beat F4.
	f1 := lfMsg(t, lfE1, "2024-07-01T10:00:00.000Z", c1, -1, "active")
	f2 := lfMsg(t, lfE2, "2024-07-01T10:00:02Z", c1, -1, "suspended")
	f3 := lfMsg(t, lfE3, "2024-07-01T10:00:01.000Z", c1, -1, "closed")
	f4 := lfMsg(t, lfE5, "2024-07-01T12:00:02.000+02:00", c1, -1, "reactivated")
	// Another family, interleaved: G2 is older than G1 only at full
	// precision (as text "…01Z" sorts after "…01.5Z").
	g1 := lfMsg(t, lfE6, "2024-07-01T10:00:01.5Z", c2, -1, "gold")
	g2 := lfMsg(t, uuid.Must(uuid.NewV7()).String(), "2024-07-01T10:00:01Z", c2, -1, "silver")

	var mu sync.Mutex
	var calls []string
	h := e.chain("crm", e.stateHandler(func(msg *message.Message) {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, string(msg.Payload))
	}))
	pub := e.publisher(&lfQueue{})
	step := func(msg *message.Message) {
		require.NoError(t, pub.Publish("customer.status", msg))
		require.NoError(t, deliver(h, msg), "every message is acked")
	}
	step(f1)
	step(g1)
	step(f2)
	step(f3)
	step(g2)
	step(f4)
	require.Equal(t, []string{"active", "gold", "suspended", "reactivated"}, calls)
	require.EqualValues(t, 2, e.counter.Count(versioned.FilterObsolete), "F3 and G2")
	require.EqualValues(t, 2, e.outcomes.Count(inbox.OutcomeObsolete), "skips are recorded like duplicates")

	value, eventID := e.state("c-1")
	require.Equal(t, "reactivated", value)
	require.Equal(t, lfE5, eventID, "F4 wins the tie with F2 by event_id")
	value, _ = e.state("c-2")
	require.Equal(t, "gold", value)

	// A redelivery of F3 is dropped: first as a duplicate (its claim
	// committed with the skip), then, once its processed row is gone, by
	// the filter itself.
	require.NoError(t, deliver(h, f3))
	require.EqualValues(t, 1, e.outcomes.Count(inbox.OutcomeDuplicate))
	e.forgetProcessed(lfE3)
	require.NoError(t, deliver(h, f3))
	require.EqualValues(t, 3, e.counter.Count(versioned.FilterObsolete))
	require.Len(t, calls, 4, "the handler never saw F3")

	// Everything published before the consumer starts: only the latest of
	// each family reaches the handler, F4 beating F2 on the tie again.
	calls = nil
	fresh := e.chain("crm-2", e.stateHandler(func(msg *message.Message) { calls = append(calls, string(msg.Payload)) }))
	for _, m := range []*message.Message{f1, f2, f3, f4, g1, g2} {
		require.NoError(t, deliver(fresh, m))
	}
	require.Equal(t, []string{"reactivated", "gold"}, calls)

	// The reverse tie: a message at F4's instant with a smaller event id
	// than F4 is older than F4, whenever it is published.
	f5 := lfMsg(t, "01906dbc-ad03-70d4-8d4e-5f6a7b8c9d0e", "2024-07-01T10:00:02.000000000Z", c1, -1, "deleted")
	require.NoError(t, pub.Publish("customer.status", f5))
	require.NoError(t, deliver(h, f5))
	require.Len(t, calls, 2)
	value, _ = e.state("c-1")
	require.Equal(t, "reactivated", value)
}

// The producer updates one product 100 times before the consumer starts:
// the handler runs once, for the last update, and the 99 others are acked as
// obsolete. A real Watermill router (in-memory broker) runs the chain
// Recoverer → Idempotent → LatestFilter → handler.
func TestLatestFilter100UpdatesQueued(t *testing.T) {
	t.Parallel()
	for _, store := range lfStores {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			e := newLFEnv(t, store)
			ctx := context.Background()
			broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 128}, watermill.NopLogger{})
			t.Cleanup(func() { _ = broker.Close() })

			product := versioned.Family{Kind: "product.index", ID: "p-123"}
			pub := e.publisher(broker)
			var last string
			for seq := int64(1); seq <= 100; seq++ {
				msg := lfSeqMsg(t, product, seq)
				last = msg.UUID
				require.NoError(t, pub.Publish("products", msg))
			}

			// Attempts end (commit included) in the idempotent middleware's
			// recorder: wait for 100 of them.
			finished := make(chan inbox.Observation, 100)
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: e.beginner,
				Consumer: "indexer",
				Recorder: outcomeFunc(func(o inbox.Observation) {
					e.outcomes.RecordOutcome(o)
					finished <- o
				}),
			}, nil)
			require.NoError(t, err)
			filter := e.filter("indexer")

			var calls atomic.Int32
			var handled atomic.Value
			router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			require.NoError(t, err)
			router.AddMiddleware(wmw.Recoverer, idem.Middleware, filter.Middleware)
			router.AddConsumerHandler("indexer", "products", broker, func(msg *message.Message) error {
				calls.Add(1)
				handled.Store(msg.UUID)
				_, err := e.stateHandler(func(*message.Message) {})(msg)
				return err
			})
			runCtx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- router.Run(runCtx) }()
			t.Cleanup(func() {
				cancel()
				require.NoError(t, <-done)
			})

			deadline := time.After(60 * time.Second)
			for i := 0; i < 100; i++ {
				select {
				case <-finished:
				case <-deadline:
					t.Fatalf("only %d of 100 messages finished", i)
				}
			}
			require.NoError(t, router.Close())
			require.EqualValues(t, 1, calls.Load(), "the handler runs once")
			require.Equal(t, last, handled.Load(), "for the last update")
			require.EqualValues(t, 99, e.counter.Count(versioned.FilterObsolete))
			require.EqualValues(t, 1, e.counter.Count(versioned.FilterHandled))
			require.Equal(t, 99, e.outcomes.Count(inbox.OutcomeObsolete))
			require.Equal(t, 1, e.outcomes.Count(inbox.OutcomeProcessed))
			require.Equal(t, 100, e.count(`SELECT count(*) FROM processed_event`), "all 100 claimed and acked")
			value, _ := e.state("p-123")
			require.Equal(t, `v100`, value)
		})
	}
}

type outcomeFunc func(inbox.Observation)

func (f outcomeFunc) RecordOutcome(o inbox.Observation) { f(o) }

// A late older message after a newer one was applied is stale when no latest
// record says so (published without one, or the record was purged, expired
// or flushed): the applied record, kept in the handler's transaction,
// drops it.
func TestLatestFilterLateOlderIsStale(t *testing.T) {
	t.Parallel()
	for _, store := range lfStores {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			e := newLFEnv(t, store)
			f := versioned.Family{Kind: "product.index", ID: "p-1"}
			var calls []string
			h := e.chain("indexer", e.stateHandler(func(msg *message.Message) { calls = append(calls, string(msg.Payload)) }))

			// Published without a latest record (a plain publisher).
			m1, m2 := lfSeqMsg(t, f, 1), lfSeqMsg(t, f, 2)
			require.NoError(t, deliver(h, m2))
			require.NoError(t, deliver(h, m1))
			require.Equal(t, []string{`v2`}, calls)
			require.EqualValues(t, 1, e.counter.Count(versioned.FilterStale))
			require.EqualValues(t, 0, e.counter.Count(versioned.FilterObsolete))

			// Published with records, which are then lost.
			pub := e.publisher(&lfQueue{})
			m3, m4 := lfSeqMsg(t, f, 3), lfSeqMsg(t, f, 4)
			require.NoError(t, pub.Publish("t", m3, m4))
			require.NoError(t, deliver(h, m4))
			e.forgetLatest()
			require.NoError(t, deliver(h, m3))
			require.Equal(t, []string{`v2`, `v4`}, calls)
			require.EqualValues(t, 2, e.counter.Count(versioned.FilterStale))

			// The same message again after its processed row was purged:
			// not newer than itself, stale.
			_, err := e.pool.Exec(context.Background(), `DELETE FROM processed_event; DELETE FROM processed_event_v7`)
			require.NoError(t, err)
			require.NoError(t, deliver(h, m4))
			require.EqualValues(t, 3, e.counter.Count(versioned.FilterStale))
			value, _ := e.state("p-1")
			require.Equal(t, `v4`, value)
			require.Equal(t, 3, e.outcomes.Count(inbox.OutcomeStale))
		})
	}
}

// A failed handler rolls the applied record back with everything else: the
// retry is handled, not stale.
func TestLatestFilterHandlerFailureRollsBackApplied(t *testing.T) {
	t.Parallel()
	e := newLFEnv(t, "postgres")
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	var calls atomic.Int32
	h := e.chain("indexer", func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 1 {
			return nil, errors.New("index unavailable")
		}
		return e.stateHandler(func(*message.Message) {})(msg)
	})
	m := lfSeqMsg(t, f, 7)
	require.ErrorContains(t, deliver(h, m), "index unavailable")
	require.Equal(t, 0, e.count(`SELECT count(*) FROM family_applied`))
	require.NoError(t, deliver(h, m))
	require.EqualValues(t, 2, calls.Load())
	require.EqualValues(t, 2, e.counter.Count(versioned.FilterHandled))
	require.EqualValues(t, 0, e.counter.Count(versioned.FilterStale))

	// A panic too (Recoverer outside the idempotent middleware).
	m8 := lfSeqMsg(t, f, 8)
	hp := e.chain("indexer", func(*message.Message) ([]*message.Message, error) { panic("boom") })
	var rp wmw.RecoveredPanicError
	require.ErrorAs(t, deliver(hp, m8), &rp)
	require.NoError(t, deliver(h, m8))
	value, _ := e.state("p-1")
	require.Equal(t, `v8`, value)
}

// Messages without family metadata pass through untouched; invalid family
// metadata and a filter outside the idempotent middleware are permanent
// errors, and the handler is not called.
func TestLatestFilterPassThroughAndRejects(t *testing.T) {
	t.Parallel()
	e := newLFEnv(t, "postgres")
	var calls atomic.Int32
	h := e.chain("indexer", func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	plain := lfSeqMsg(t, versioned.Family{Kind: "k", ID: "i"}, 1)
	for _, k := range []string{versioned.MetadataFamilyKind, versioned.MetadataFamilyID, versioned.MetadataFamilySeq} {
		delete(plain.Metadata, k)
	}
	require.NoError(t, deliver(h, plain))
	require.NoError(t, deliver(h, plain)) // a duplicate, by the claim
	require.EqualValues(t, 1, calls.Load())
	require.EqualValues(t, 1, e.counter.Count(versioned.FilterNoFamily))
	require.Equal(t, 0, e.count(`SELECT count(*) FROM family_applied`))

	half := lfSeqMsg(t, versioned.Family{Kind: "k", ID: "i"}, 1)
	delete(half.Metadata, versioned.MetadataFamilyID)
	badSeq := lfSeqMsg(t, versioned.Family{Kind: "k", ID: "i"}, 1)
	badSeq.Metadata.Set(versioned.MetadataFamilySeq, "1e3")
	for _, bad := range []*message.Message{half, badSeq} {
		err := deliver(h, bad)
		require.ErrorIs(t, err, versioned.ErrFamilyInvalid)
		require.True(t, inbox.IsPermanent(err), "poisoned, not retried: %v", err)
	}
	require.EqualValues(t, 1, calls.Load())
	require.EqualValues(t, 2, e.counter.Count(versioned.FilterRejected))

	// Outside the idempotent middleware: no transaction to record in.
	outside := e.filter("indexer").Middleware(func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	err := deliver(outside, lfSeqMsg(t, versioned.Family{Kind: "k", ID: "i"}, 2))
	require.ErrorIs(t, err, versioned.ErrNoTransaction)
	require.True(t, inbox.IsPermanent(err))

	// No consumer configured and no handler name: the filter takes the
	// consumer the idempotent middleware claimed with.
	f, err := versioned.NewLatestFilter(versioned.LatestFilterConfig{Families: e.families}, nil)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: e.beginner, Consumer: "claims-as-this"}, nil)
	require.NoError(t, err)
	err = deliver(idem.Middleware(f.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })),
		lfSeqMsg(t, versioned.Family{Kind: "k", ID: "i"}, 3))
	require.NoError(t, err)
	require.Equal(t, 1, e.count(`SELECT count(*) FROM family_applied WHERE consumer = 'claims-as-this'`))
	require.EqualValues(t, 1, calls.Load())

	_, err = versioned.NewLatestFilter(versioned.LatestFilterConfig{}, nil)
	require.ErrorContains(t, err, "LatestFilterConfig.Families")
}

// Families are independent under concurrency: many families, updates
// published in a shuffled order before the consumers start, several workers.
// Each family's handler runs exactly once, for its latest update.
func TestLatestFilterFamiliesIndependentConcurrent(t *testing.T) {
	t.Parallel()
	const families, updates, workers = 24, 15, 6
	for _, store := range lfStores {
		t.Run(store, func(t *testing.T) {
			t.Parallel()
			e := newLFEnv(t, store)
			queue := &lfQueue{}
			pub := e.publisher(queue)
			var all []*message.Message
			for seq := int64(1); seq <= updates; seq++ {
				for i := 0; i < families; i++ {
					all = append(all, lfSeqMsg(t, versioned.Family{Kind: "product.index", ID: fmt.Sprintf("p-%02d", i)}, seq))
				}
			}
			lfShuffle(1, all) // published out of order within each family too
			for _, m := range all {
				require.NoError(t, pub.Publish("products", m))
			}

			calls := newLFCalls()
			h := e.chain("indexer", e.stateHandler(calls.add))
			runWorkers(t, workers, queue.take(), h)

			require.EqualValues(t, families, e.counter.Count(versioned.FilterHandled))
			require.EqualValues(t, families*(updates-1), e.counter.Count(versioned.FilterObsolete))
			for i := 0; i < families; i++ {
				id := fmt.Sprintf("p-%02d", i)
				require.Equal(t, []string{fmt.Sprintf(`v%d`, updates)}, calls.of(id), id)
				value, _ := e.state(id)
				require.Equal(t, fmt.Sprintf(`v%d`, updates), value)
			}
		})
	}
}

// Publishing and consuming at the same time, several workers, many families,
// deliveries out of order: each family's handler calls happen in strictly
// increasing order (never an older update after a newer one), and each
// family ends at its latest update.
// Run for both latest stores on PostgreSQL (pgx), and for the SQL family
// store on MariaDB and SQLite.
func TestLatestFilterConcurrentProducersAndWorkers(t *testing.T) {
	t.Parallel()
	const families, updates, workers = 12, 20, 4
	for _, run := range [][2]string{
		{"postgres", "pgx"}, {"redis", "pgx"},
		{"postgres", testenv.TargetMariaDB}, {"postgres", testenv.TargetSQLite},
	} {
		store, target := run[0], run[1]
		name := store
		if target != "pgx" {
			name = target
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newLFEnvWith(t, store, target)
			calls := newLFCalls()
			h := e.chain("indexer", e.stateHandler(calls.add))

			deliveries := make(chan *message.Message, families*updates)
			var producers sync.WaitGroup
			for i := 0; i < families; i++ {
				producers.Add(1)
				go func() {
					defer producers.Done()
					queue := &lfQueue{}
					pub := e.publisher(queue)
					f := versioned.Family{Kind: "product.index", ID: fmt.Sprintf("p-%02d", i)}
					var batch []*message.Message
					for seq := int64(1); seq <= updates; seq++ {
						if err := pub.Publish("products", lfSeqMsg(t, f, seq)); err != nil {
							t.Error(err)
							return
						}
						batch = append(batch, queue.take()...)
						if len(batch) == 4 || seq == updates { // reorder within small windows
							lfShuffle(uint64(i)*1000+uint64(seq), batch)
							for _, m := range batch {
								deliveries <- m
							}
							batch = nil
						}
					}
				}()
			}
			go func() {
				producers.Wait()
				close(deliveries)
			}()
			runWorkersFrom(t, workers, deliveries, h)

			total := e.counter.Count(versioned.FilterHandled) + e.counter.Count(versioned.FilterObsolete) + e.counter.Count(versioned.FilterStale)
			require.EqualValues(t, families*updates, total)
			for i := 0; i < families; i++ {
				id := fmt.Sprintf("p-%02d", i)
				seqs := calls.seqs(t, id)
				require.NotEmpty(t, seqs, id)
				require.IsIncreasing(t, seqs, "%s: handler calls in order", id)
				require.Equal(t, updates, seqs[len(seqs)-1], "%s: the latest update was handled", id)
				value, _ := e.state(id)
				require.Equal(t, fmt.Sprintf(`v%d`, updates), value)
			}
		})
	}
}

// Redis flushed mid-run (expiry, eviction, restart): the filter lets more
// messages through, never drops the latest one, and never applies an older
// update after a newer one (the applied records are in PostgreSQL).
func TestLatestFilterRedisFlushedMidRun(t *testing.T) {
	t.Parallel()
	const families, updates, workers = 16, 12, 4
	e := newLFEnv(t, "redis")
	queue := &lfQueue{}
	pub := e.publisher(queue)
	for seq := int64(1); seq <= updates; seq++ {
		for i := 0; i < families; i++ {
			require.NoError(t, pub.Publish("products", lfSeqMsg(t, versioned.Family{Kind: "product.index", ID: fmt.Sprintf("p-%02d", i)}, seq)))
		}
	}
	all := queue.take()
	lfShuffle(7, all)
	calls := newLFCalls()
	h := e.chain("indexer", e.stateHandler(calls.add))

	// First half with the records, then Redis loses everything.
	runWorkers(t, workers, all[:len(all)/2], h)
	handledBefore := e.counter.Count(versioned.FilterHandled)
	require.Positive(t, e.forgetRedis(), "the flush removed records")

	// Some families get a newer update after the flush: recorded again.
	for i := 0; i < families; i += 4 {
		require.NoError(t, pub.Publish("products", lfSeqMsg(t, versioned.Family{Kind: "product.index", ID: fmt.Sprintf("p-%02d", i)}, updates+1)))
	}
	rest := append(all[len(all)/2:], queue.take()...)
	lfShuffle(8, rest)
	runWorkers(t, workers, rest, h)

	require.Greater(t, e.counter.Count(versioned.FilterHandled), handledBefore, "the second half got through")
	require.Zero(t, e.counter.LatestUnknown(), "a missing key is not an error")
	for i := 0; i < families; i++ {
		id := fmt.Sprintf("p-%02d", i)
		want := updates
		if i%4 == 0 {
			want = updates + 1
		}
		seqs := calls.seqs(t, id)
		require.IsIncreasing(t, seqs, "%s: never an older update after a newer one", id)
		require.Equal(t, want, seqs[len(seqs)-1], "%s: the latest update was handled", id)
		value, _ := e.state(id)
		require.Equal(t, fmt.Sprintf(`v%d`, want), value)
	}
}

// Redis unreachable on the consumer side: the filter logs, counts the
// message as LatestUnknown and judges it by the applied check alone.
func TestLatestFilterRedisDownFailsOpen(t *testing.T) {
	t.Parallel()
	e := newLFEnv(t, "redis")
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	pub := e.publisher(&lfQueue{})
	m1, m2 := lfSeqMsg(t, f, 1), lfSeqMsg(t, f, 2)
	require.NoError(t, pub.Publish("t", m1, m2))

	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = down.Close() })
	e.latest, _ = redislatest.New(redislatest.Config{Client: down, Prefix: e.redisPrefix})
	var calls []string
	h := e.chain("indexer", e.stateHandler(func(msg *message.Message) { calls = append(calls, string(msg.Payload)) }))
	require.NoError(t, deliver(h, m2))
	require.NoError(t, deliver(h, m1))
	require.Equal(t, []string{`v2`}, calls, "m2 let through, m1 stale")
	require.EqualValues(t, 2, e.counter.LatestUnknown())
	require.EqualValues(t, 1, e.counter.Count(versioned.FilterStale))
}

// The latest table read through LatestQuerier (the producers' database is
// another one): same verdicts, in two statements.
func TestLatestFilterLatestQuerier(t *testing.T) {
	t.Parallel()
	e := newLFEnv(t, "postgres")
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	pub := e.publisher(&lfQueue{})
	m1, m2 := lfSeqMsg(t, f, 1), lfSeqMsg(t, f, 2)
	require.NoError(t, pub.Publish("t", m1, m2))
	filter, err := versioned.NewRecordedLatestFilter(versioned.LatestFilterConfig{
		Families: e.families, LatestDB: e.tg.Handle(), Consumer: "indexer",
	}, e.counter, nil)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: e.beginner, Consumer: "indexer"}, nil)
	require.NoError(t, err)
	var calls []string
	h := idem.Middleware(filter.Middleware(e.stateHandler(func(msg *message.Message) { calls = append(calls, string(msg.Payload)) })))
	require.NoError(t, deliver(h, m1))
	require.NoError(t, deliver(h, m2))
	require.Equal(t, []string{`v2`}, calls)
	require.EqualValues(t, 1, e.counter.Count(versioned.FilterObsolete))
}

// lfCalls records handler calls per family, in call order.
type lfCalls struct {
	mu sync.Mutex
	by map[string][]string
}

func newLFCalls() *lfCalls { return &lfCalls{by: map[string][]string{}} }

func (c *lfCalls) add(msg *message.Message) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := msg.Metadata.Get(versioned.MetadataFamilyID)
	c.by[id] = append(c.by[id], string(msg.Payload))
}

func (c *lfCalls) of(id string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.by[id]...)
}

func (c *lfCalls) seqs(t *testing.T, id string) []int {
	t.Helper()
	var out []int
	for _, p := range c.of(id) {
		var n int
		_, err := fmt.Sscanf(p, `v%d`, &n)
		require.NoError(t, err)
		out = append(out, n)
	}
	return out
}

// runWorkers delivers msgs to h from n goroutines and waits for all.
func runWorkers(t *testing.T, n int, msgs []*message.Message, h message.HandlerFunc) {
	t.Helper()
	ch := make(chan *message.Message, len(msgs))
	for _, m := range msgs {
		ch <- m
	}
	close(ch)
	runWorkersFrom(t, n, ch, h)
}

// runWorkersFrom delivers what ch yields to h from n goroutines until ch is
// closed. Each delivery must be acked (nil error); a failing one is retried
// (as the broker would redeliver it), at most 20 times.
func runWorkersFrom(t *testing.T, n int, ch <-chan *message.Message, h message.HandlerFunc) {
	t.Helper()
	var wg sync.WaitGroup
	for w := 0; w < n; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range ch {
				var err error
				for attempt := 0; attempt < 20; attempt++ {
					if err = deliver(h, m); err == nil || !mysqlTransient(err) {
						break
					}
				}
				if err != nil {
					t.Errorf("delivery of %s: %v", m.UUID, err)
				}
			}
		}()
	}
	wg.Wait()
}
