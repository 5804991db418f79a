// Command idembench runs the benchmarks of package bench and prints a table
// and, as its last line, one JSON object (see bench.RequiredKeys).
//
//	go run ./bench/cmd/idembench -quick       # make bench-quick
//	go run ./bench/cmd/idembench              # make bench (full sizes)
//	go run ./bench/cmd/idembench -quick -parts overhead -cpuprofile cpu.out
//
// Services: DATABASE_URL, AMQP_URL and NATS_URL, or the local defaults of
// the tests.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/watermill-idempotency/idempotency/bench"
)

func main() {
	bench.RunCountChild() // the counts part's child (under valgrind): runs and exits
	quick := flag.Bool("quick", false, "small sizes (under a minute)")
	parts := flag.String("parts", "all", "comma-separated parts: overhead,growth,e2e,purge,memory,relay,counts")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the run to this file")
	rounds := flag.Int("rounds", 0, "override the interleaved rounds of the overhead and experiments parts")
	dur := flag.Duration("dur", 0, "override the per-variant duration of one round (overhead, experiments)")
	e2eRounds := flag.Int("e2e-rounds", 0, "override the interleaved rounds of the e2e part (RabbitMQ and JetStream)")
	e2eMessages := flag.Int("e2e-messages", 0, "override the messages per e2e run")
	results := flag.String("results", "", "also write the result as markdown to this file (bench/RESULTS.md)")
	noCheckpoint := flag.Bool("no-checkpoint", false, "do not CHECKPOINT before measuring WAL per claim")
	growthRows := flag.String("growth-rows", "", "override the growth part's table sizes: comma-separated row counts, the first 0 (e.g. 0,1000000,10000000)")
	flag.Parse()

	sizes := bench.Full
	if *quick {
		sizes = bench.Quick
	}
	if *rounds > 0 {
		sizes.Overhead.Rounds = *rounds
	}
	if *dur > 0 {
		sizes.Overhead.Dur = *dur
	}
	if *e2eRounds > 0 {
		sizes.E2E.Rounds = *e2eRounds
	}
	if *e2eMessages > 0 {
		sizes.E2E.Messages = *e2eMessages
	}
	if *growthRows != "" {
		var rows []int
		for _, f := range strings.Split(*growthRows, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 0 || (len(rows) == 0 && n != 0) {
				fmt.Fprintf(os.Stderr, "idembench: -growth-rows %q: row counts ≥ 0, the first 0\n", *growthRows)
				os.Exit(2)
			}
			rows = append(rows, n)
		}
		sizes.Growth.Rows = rows
	}
	ps, err := bench.ParseParts(*parts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	start := time.Now()
	loadStart := bench.LoadAverage()
	res, err := bench.Run(ctx, bench.Options{Sizes: sizes, Parts: ps, Log: os.Stderr, Checkpoint: !*noCheckpoint})
	if err != nil {
		fmt.Fprintln(os.Stderr, "idembench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "idembench: %s run took %s\n", sizes.Name, time.Since(start).Round(time.Second))
	if *results != "" {
		cmd := "go run ./bench/cmd/idembench " + strings.Join(os.Args[1:], " ")
		if err := res.WriteMarkdown(*results, strings.TrimSpace(cmd), time.Since(start), loadStart, bench.LoadAverage()); err != nil {
			fmt.Fprintln(os.Stderr, "idembench:", err)
			os.Exit(1)
		}
	}
	res.Print(os.Stdout)
}
