package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// percentile returns the nearest-rank q-quantile (0 < q ≤ 1) of d, sorting
// it in place; 0 for no samples.
func percentile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	if !slices.IsSorted(d) {
		slices.Sort(d)
	}
	i := int(math.Ceil(q*float64(len(d)))) - 1
	if i < 0 {
		i = 0
	}
	return d[min(i, len(d)-1)]
}

func maxDur(d []time.Duration) time.Duration {
	var m time.Duration
	for _, x := range d {
		m = max(m, x)
	}
	return m
}

// median of xs (NaN for none); xs is not modified.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// ratio is a/b, NaN when b is 0 (the caller reports NaN as missing).
func ratio(a, b float64) float64 {
	if b == 0 {
		return math.NaN()
	}
	return a / b
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// claimSink is a middleware.Recorder that keeps the claim latency
// (Observation.Claim: acquire + BEGIN + claim, one round trip when pipelined)
// of every processed or duplicate attempt while it is armed.
type claimSink struct {
	armed atomic.Bool
	mu    sync.Mutex
	claim []time.Duration
}

var _ inbox.Recorder = (*claimSink)(nil)

func (s *claimSink) RecordOutcome(o inbox.Observation) {
	if !s.armed.Load() || o.Claim == 0 {
		return
	}
	s.mu.Lock()
	s.claim = append(s.claim, o.Claim)
	s.mu.Unlock()
}

// start clears the samples and arms the sink; stop disarms it and returns them.
func (s *claimSink) start() {
	s.mu.Lock()
	s.claim = s.claim[:0]
	s.mu.Unlock()
	s.armed.Store(true)
}

func (s *claimSink) stop() []time.Duration {
	s.armed.Store(false)
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.claim)
}

// cpuMeter reads the CPU time used by this process (every thread) and by
// the PostgreSQL backends of a pool, from /proc/<pid>/schedstat
// (nanoseconds). CPU per message is much less sensitive to other work on a
// shared machine than a rate is; it is reported beside the rates. It only
// works when PostgreSQL runs on this machine; otherwise ok is false.
type cpuMeter struct {
	pids []int
}

func newCPUMeter(ctx context.Context, pool *pgxpool.Pool) *cpuMeter {
	m := &cpuMeter{}
	for _, c := range pool.AcquireAllIdle(ctx) {
		m.pids = append(m.pids, int(c.Conn().PgConn().PID()))
		c.Release()
	}
	return m
}

// read returns the CPU time used so far by the backends and by this
// process; ok is false when a backend's schedstat is unreadable.
func (m *cpuMeter) read() (server, client time.Duration, ok bool) {
	for _, pid := range m.pids {
		d, ok := schedstat(fmt.Sprintf("/proc/%d/schedstat", pid))
		if !ok {
			return 0, 0, false
		}
		server += d
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0, 0, false
	}
	for _, t := range tasks {
		if d, ok := schedstat("/proc/self/task/" + t.Name() + "/schedstat"); ok {
			client += d
		}
	}
	return server, client, len(m.pids) > 0
}

func schedstat(path string) (time.Duration, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, false
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return 0, false
	}
	return time.Duration(ns), true
}

// spread summarises per-round ratios: their median, extremes and quartiles
// (nearest rank on the sorted values; with fewer than 4 rounds the quartiles
// are the extremes). n is the number of rounds.
type spread struct {
	med, min, q1, q3, max float64
	n                     int
}

func spreadOf(xs []float64) spread {
	if len(xs) == 0 {
		nan := math.NaN()
		return spread{nan, nan, nan, nan, nan, 0}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	q := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[min(max(i, 0), len(s)-1)]
	}
	return spread{med: median(s), min: s[0], q1: q(0.25), q3: q(0.75), max: s[len(s)-1], n: len(s)}
}

// String is "min–max (IQR q1–q3, n rounds)", or "-" for no rounds.
func (s spread) String() string {
	if s.n == 0 {
		return "-"
	}
	return fmt.Sprintf("%s–%s (IQR %s–%s, %d rounds)", f3(s.min), f3(s.max), f3(s.q1), f3(s.q3), s.n)
}

// short is "min–max" ("-" for no rounds), for table cells.
func (s spread) short() string {
	if s.n == 0 {
		return "-"
	}
	return f3(s.min) + "–" + f3(s.max)
}
