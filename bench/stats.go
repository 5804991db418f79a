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

	"github.com/watermill-idempotency/idempotency/middleware"
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

var _ middleware.Recorder = (*claimSink)(nil)

func (s *claimSink) RecordOutcome(o middleware.Observation) {
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
