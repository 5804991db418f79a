package inbox

import (
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// StallAfter is how long (at least, and at least twice
// ChainConfig.MaxInterval) the chain lets its attempts go without one of them
// finishing before it reports them as stalled: a database that stops
// answering with its connection left open (a network partition, a hung
// proxy, a paused VM) blocks an attempt with no error to hold or retry
// (TCP keepalive takes minutes to notice; pgx waits on the socket). While
// any attempt is in flight and none has finished for StallAfter, the chain
// logs at ERROR every StallAfter and records OutcomeStalled once per report.
// The attempt itself is left alone: it may be a handler's own long call,
// and its transaction holds the claim until it ends.
const StallAfter = time.Minute

// stallWatch counts a chain's attempts in flight and when one last started
// or finished; a watcher goroutine runs only while some are in flight.
type stallWatch struct {
	inflight atomic.Int64
	progress atomic.Int64 // unix nanoseconds of the last start or finish
	running  atomic.Bool
}

// begin marks an attempt started and starts the watcher if none runs.
func (w *stallWatch) begin(p *holdPoison) {
	w.progress.Store(time.Now().UnixNano())
	w.inflight.Add(1)
	if !w.running.Load() && w.running.CompareAndSwap(false, true) {
		go w.watch(p)
	}
}

// touch marks progress without changing the count: an attempt of a held
// or retried delivery finished, and the next one is about to start.
func (w *stallWatch) touch() { w.progress.Store(time.Now().UnixNano()) }

// end marks an attempt finished (whatever its outcome).
func (w *stallWatch) end() {
	w.progress.Store(time.Now().UnixNano())
	w.inflight.Add(-1)
}

// watch reports a stall every w.every while attempts are in flight and
// none started or finished; it returns when none is in flight.
func (w *stallWatch) watch(p *holdPoison) {
	every := time.Duration(stallEvery.Load())
	if every <= 0 {
		// Above two of the hold's waits: a held delivery sleeping
		// between attempts is not stalled.
		every = max(StallAfter, 2*p.cfg.MaxInterval)
	}
	t := time.NewTicker(every / 4)
	defer t.Stop()
	var reported time.Time
	for range t.C {
		if w.inflight.Load() <= 0 {
			w.running.Store(false)
			// An attempt that began between the load and the store saw
			// running true and started no watcher: take it over.
			if w.inflight.Load() <= 0 || !w.running.CompareAndSwap(false, true) {
				return
			}
			continue
		}
		last := time.Unix(0, w.progress.Load())
		idle := time.Since(last)
		if idle < every || time.Since(reported) < every {
			continue
		}
		reported = time.Now()
		p.logger.Error("Attempts stalled: none finished", errStalled, watermill.LogFields{
			"in_flight": w.inflight.Load(), "for": idle.Round(time.Second).String(),
			"hint": "the database or the handler does not answer (a hung connection, a network partition, a lock held elsewhere); the delivery stays unacknowledged until the attempt ends",
		})
		if m := p.cfg.Idempotent; m != nil {
			m.cfg.Recorder.RecordOutcome(Observation{Consumer: m.cfg.Consumer, Outcome: OutcomeStalled, Total: idle})
		}
	}
}

type stalledError struct{}

func (stalledError) Error() string { return "no attempt finished within the stall bound" }

var errStalled error = stalledError{}

// stallEvery is StallAfter, shortened by SetStallAfter in tests.
var stallEvery atomic.Int64

// SetStallAfter sets the stall bound of chains built from now on (tests
// only: the default is StallAfter) and returns a function restoring it.
func SetStallAfter(d time.Duration) (restore func()) {
	old := stallEvery.Swap(int64(d))
	return func() { stallEvery.Store(old) }
}
