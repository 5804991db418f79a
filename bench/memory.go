package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// rssBytes is this process's resident set size (Linux /proc; 0 elsewhere).
func rssBytes() int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

type memSample struct {
	rss, heap int64
}

func sampleMem() memSample {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return memSample{rss: rssBytes(), heap: int64(m.HeapAlloc)}
}

// memory measures part 5: the RSS of one running consumer (the end-to-end
// consumer with our middleware) after First and after Second messages
// (no growth expected: nothing is kept per message), and the allocations
// per message of the middleware (sequential, MemStats.Mallocs).
func memory(ctx context.Context, e *env, sz MemorySizes, consumers, prefetch int, res *Result) error {
	rig, err := newE2ERig(ctx, e, "memory", consumers)
	if err != nil {
		return err
	}
	defer e.closePool(rig.pool)

	fmt.Fprintf(e.log, "memory: pre-fill %d messages\n", sz.Second)
	q, err := rig.prefill(ctx, sz.Second, 0)
	if err != nil {
		return err
	}
	runtime.GC()
	before := sampleMem()
	var (
		mu      sync.Mutex
		samples = map[int64]memSample{}
	)
	first, second := int64(sz.First), int64(sz.Second)
	progress := func(k int64) {
		if k == first || k == second {
			s := sampleMem()
			mu.Lock()
			samples[k] = s
			mu.Unlock()
		}
	}
	fmt.Fprintf(e.log, "memory: consume %d messages\n", sz.Second)
	if _, err := rig.consume(ctx, q, e2eCell{consumers, prefetch, vOurs}, sz.Second, progress); err != nil {
		return err
	}
	e.deleteQueues()
	mu.Lock()
	s1, s2 := samples[first], samples[second]
	mu.Unlock()

	a, err := allocsPerMsg(ctx, rig, sz.AllocMsgs)
	if err != nil {
		return err
	}
	mb := func(b int64) float64 { return float64(b) / (1 << 20) }
	t := Table{
		Title:  "5. memory: consumer RSS and allocations per message",
		Header: []string{"measure", "value"},
		Rows: [][]string{
			{"RSS before consuming (MB)", f1(mb(before.rss))},
			{fmt.Sprintf("RSS after %s messages (MB)", rowsLabel(sz.First)), f1(mb(s1.rss))},
			{fmt.Sprintf("RSS after %s messages (MB)", rowsLabel(sz.Second)), f1(mb(s2.rss))},
			{fmt.Sprintf("Go heap in use after %s / %s (MB)", rowsLabel(sz.First), rowsLabel(sz.Second)), f1(mb(s1.heap)) + " / " + f1(mb(s2.heap))},
			{"allocs/msg: idempotent middleware, new event (no-op handler)", f1(a.ours)},
			{"allocs/msg: idempotent middleware, duplicate", f1(a.dup)},
			{"allocs/msg: plain pgx Begin/Commit (no dedup), for comparison", f1(a.none)},
			{"bytes/msg: idempotent, new event / plain", f0(a.oursBytes) + " / " + f0(a.noneBytes)},
		},
		Notes: []string{
			fmt.Sprintf("RSS is the whole benchmark process (one consumer: %d handlers, prefetch %d); allocations: %d sequential messages, MemStats.Mallocs.", consumers, prefetch, sz.AllocMsgs),
		},
	}
	res.Tables = append(res.Tables, t)
	res.set("allocs_per_msg", a.ours)
	res.set("allocs_per_msg_duplicate", a.dup)
	res.set("allocs_per_msg_plain", a.none)
	res.set("allocs_per_msg_plain_tx", a.none)
	res.set("rss_first_mb", mb(s1.rss))
	res.set("rss_second_mb", mb(s2.rss))
	res.set("rss_growth_mb", mb(s2.rss-s1.rss))
	return nil
}

type allocs struct {
	ours, dup, none      float64
	oursBytes, noneBytes float64
}

// allocsPerMsg runs n messages, one at a time, through the idempotent
// middleware around a no-op handler (new events, then duplicates), and
// through the plain pgx transaction for comparison. Messages are built
// before the measured loop.
func allocsPerMsg(ctx context.Context, rig *e2eRig, n int) (allocs, error) {
	measure := func(h message.HandlerFunc, msgs []*message.Message) (float64, float64, error) {
		for _, m := range msgs[:n/10] { // warm-up
			if _, err := h(m); err != nil {
				return 0, 0, err
			}
		}
		msgs = msgs[n/10:]
		var a, b runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&a)
		for _, m := range msgs {
			if _, err := h(m); err != nil {
				return 0, 0, err
			}
		}
		runtime.ReadMemStats(&b)
		k := float64(len(msgs))
		return float64(b.Mallocs-a.Mallocs) / k, float64(b.TotalAlloc-a.TotalAlloc) / k, nil
	}
	build := func(ids []uuid.UUID) ([]*message.Message, error) {
		out := make([]*message.Message, 0, n+n/10)
		for i := 0; i < n+n/10; i++ {
			var m *message.Message
			var err error
			if ids != nil {
				m, err = marshaler.NewMessageWithID(ids[i%len(ids)], eventName, time.Now().UTC(), payload())
			} else {
				m, err = newV7()
			}
			if err != nil {
				return nil, err
			}
			m.SetContext(ctx)
			out = append(out, m)
		}
		return out, nil
	}
	var r allocs
	msgs, err := build(nil)
	if err != nil {
		return r, err
	}
	if r.ours, r.oursBytes, err = measure(rig.vs.ours.Middleware(noopHandler), msgs); err != nil {
		return r, err
	}
	if msgs, err = build(nil); err != nil {
		return r, err
	}
	if r.none, r.noneBytes, err = measure(txMiddleware(rig.pool)(noopHandler), msgs); err != nil {
		return r, err
	}
	ids, err := preclaim(ctx, rig.pool, rig.store, 100)
	if err != nil {
		return r, err
	}
	if msgs, err = build(ids); err != nil {
		return r, err
	}
	if r.dup, _, err = measure(rig.vs.dup.Middleware(noopHandler), msgs); err != nil {
		return r, err
	}
	return r, nil
}
