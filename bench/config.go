package bench

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Sizes is one benchmark profile: Quick (make bench-quick), Full (make
// bench) or Tiny (the test that keeps the quick code path working).
type Sizes struct {
	Name string

	// Overhead: the claim next to the handler's transaction, no broker.
	Overhead OverheadSizes
	// Growth: claim latency against the processed table's size.
	Growth GrowthSizes
	// E2E: through RabbitMQ, marshaler, router, chain, handler, ack.
	E2E E2ESizes
	// Purge: the purger deleting expired rows while consumers claim.
	Purge PurgeSizes
	// Memory: RSS of a running consumer; allocations per message.
	Memory MemorySizes
	// Counts: instructions (client and server), WAL and allocations per
	// message under cachegrind; zero: not measured.
	Counts CountSizes
}

// OverheadSizes sizes part 1 (claim overhead, no broker).
type OverheadSizes struct {
	Workers  []int         // concurrent workers; HeadlineWorkers must be one of them
	Rounds   int           // interleaved rounds (one run of every variant each)
	Dur      time.Duration // per variant per round
	Warmup   time.Duration // per variant, once, not measured
	MinCount int           // at least this many messages per run
	// Variants3 are the variants run with the three-statement handler (the
	// one-statement handler runs all of them).
	Variants3 []string
	DupIDs    int // already-processed ids the duplicate variant cycles through
}

// HeadlineWorkers is the worker count of the headline ratios.
const HeadlineWorkers = 4

// GrowthSizes sizes part 2 (claim latency as the processed table grows).
type GrowthSizes struct {
	Rows      []int // table sizes, the first 0; the ratio is last ÷ first
	Workers   int
	Rounds    int
	Dur       time.Duration
	MinCount  int
	WALClaims int // sequential claims whose WAL is measured, per table
}

// E2ESizes sizes part 3 (end to end over RabbitMQ and over NATS JetStream).
type E2ESizes struct {
	// Consumers × Prefetch is RabbitMQ's grid of cells (none and
	// idempotent each); JetStream runs the headline cell only.
	Consumers []int // consumer goroutines (router handlers on the queue)
	Prefetch  []int
	Messages  int // per run (pre-filled queue or stream)
	Rounds    int
	// GridRounds: the grid's cells run in the first GridRounds rounds only
	// (0: in every round); the headline cells run in every round, so that
	// their spread over the rounds means something.
	GridRounds int
	// HeadConsumers/HeadPrefetch is the cell of e2e_ratio; it is always run,
	// with the 30 % duplicate mix, even when not in the lists above.
	HeadConsumers, HeadPrefetch int
}

// PurgeSizes sizes part 4 (purge under load).
type PurgeSizes struct {
	Rows     int // expired rows deleted per round
	Rounds   int
	Workers  int
	BaseDur  time.Duration // load without the purge, per round
	MinCount int
}

// MemorySizes sizes part 5 (consumer memory and allocations).
type MemorySizes struct {
	First, Second int // RSS is read after this many messages
	AllocMsgs     int // sequential messages for allocations per message
}

// Quick is `make bench-quick`: every part on small sizes, under a minute.
var Quick = Sizes{
	Name: "quick",
	Overhead: OverheadSizes{
		Workers: []int{4}, Rounds: 12, Dur: 120 * time.Millisecond, Warmup: 100 * time.Millisecond,
		MinCount: 50, Variants3: []string{vNone, vOurs, vInMemory}, DupIDs: 20000,
	},
	Growth: GrowthSizes{Rows: []int{0, 100_000}, Workers: 2, Rounds: 6, Dur: 250 * time.Millisecond, MinCount: 100, WALClaims: 300},
	E2E:    E2ESizes{Consumers: nil, Prefetch: nil, Messages: 1200, Rounds: 4, HeadConsumers: 4, HeadPrefetch: 50},
	Purge:  PurgeSizes{Rows: 100_000, Rounds: 3, Workers: 4, BaseDur: 600 * time.Millisecond, MinCount: 100},
	Memory: MemorySizes{First: 1000, Second: 4000, AllocMsgs: 1000},
	Counts: CountSizes{N1: 200, N2: 1000},
}

// Full is `make bench`: the sizes of the issue (1M/10M rows, 100k messages).
// Sized so that `-parts overhead,e2e,memory,counts` (every figure of issue
// 17's targets) takes about 25 minutes on an idle 2-core machine: overhead
// 3 worker counts × 14 variants × (20 rounds × 0.5 s + 0.5 s warm-up) ≈ 7.4
// min (time-boxed); e2e 2 transports × 3 headline cells × 10 rounds × 3000
// messages plus RabbitMQ's grid (16 runs) in 3 rounds ≈ 324k messages;
// memory 100k messages; counts under valgrind.
var Full = Sizes{
	Name: "full",
	Overhead: OverheadSizes{
		Workers: []int{1, 4, 16}, Rounds: 20, Dur: 500 * time.Millisecond, Warmup: 500 * time.Millisecond,
		MinCount: 200, Variants3: variants1, DupIDs: 200_000,
	},
	Growth: GrowthSizes{Rows: []int{0, 1_000_000, 10_000_000}, Workers: 2, Rounds: 8, Dur: 2 * time.Second, MinCount: 500, WALClaims: 2000},
	E2E:    E2ESizes{Consumers: []int{1, 2, 4}, Prefetch: []int{1, 10, 50}, Messages: 3000, Rounds: 10, GridRounds: 3, HeadConsumers: 4, HeadPrefetch: 50},
	Purge:  PurgeSizes{Rows: 1_000_000, Rounds: 3, Workers: 4, BaseDur: 10 * time.Second, MinCount: 500},
	Memory: MemorySizes{First: 10_000, Second: 100_000, AllocMsgs: 5000},
	Counts: CountSizes{N1: 300, N2: 1500},
}

// Tiny is the CI test's profile: every code path, seconds.
var Tiny = Sizes{
	Name: "tiny",
	Overhead: OverheadSizes{
		Workers: []int{1, 4}, Rounds: 2, Dur: 30 * time.Millisecond, Warmup: 10 * time.Millisecond,
		MinCount: 20, Variants3: variants1, DupIDs: 200,
	},
	Growth: GrowthSizes{Rows: []int{0, 1000, 2000}, Workers: 2, Rounds: 2, Dur: 40 * time.Millisecond, MinCount: 20, WALClaims: 10},
	E2E:    E2ESizes{Consumers: []int{1, 2}, Prefetch: []int{1, 10}, Messages: 40, Rounds: 1, HeadConsumers: 2, HeadPrefetch: 10},
	Purge:  PurgeSizes{Rows: 3000, Rounds: 2, Workers: 2, BaseDur: 40 * time.Millisecond, MinCount: 20},
	Memory: MemorySizes{First: 30, Second: 90, AllocMsgs: 50},
}

// Parts of a run, in order. "experiments" (claim configurations that could
// lower the cost, for proposals) runs only when asked for.
var Parts = []string{"overhead", "growth", "e2e", "purge", "memory", "relay", "counts"}

var optionalParts = []string{"experiments"}

func parseParts(s string) ([]string, error) {
	if s == "" || s == "all" {
		return Parts, nil
	}
	var out []string
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if !slices.Contains(Parts, p) && !slices.Contains(optionalParts, p) {
			return nil, fmt.Errorf("bench: unknown part %q (parts: %s)", p, strings.Join(Parts, ","))
		}
		out = append(out, p)
	}
	return out, nil
}
