package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"
)

// Options of one run.
type Options struct {
	Sizes Sizes
	// Parts to run (Parts when empty). Keys of parts not run are null.
	Parts []string
	// Log receives progress lines (os.Stderr in the command).
	Log io.Writer
	// Checkpoint issues CHECKPOINT before the WAL measurement (needs
	// superuser or pg_checkpoint); off in the CI test.
	Checkpoint bool
}

// Run runs the parts of opts on the services of testenv (DATABASE_URL,
// AMQP_URL) and returns the result; everything it created is removed before
// it returns.
func Run(ctx context.Context, opts Options) (*Result, error) {
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	parts := opts.Parts
	if len(parts) == 0 {
		parts = Parts
	}
	e, err := newEnv(ctx, opts.Log)
	if err != nil {
		return nil, err
	}
	defer e.close()
	res := &Result{Profile: opts.Sizes.Name}
	res.Machine = machine(ctx, e)
	sz := opts.Sizes
	for _, p := range parts {
		start := time.Now()
		fmt.Fprintf(opts.Log, "== %s\n", p)
		switch p {
		case "overhead":
			err = overhead(ctx, e, sz.Overhead, res)
		case "growth":
			err = growth(ctx, e, sz.Growth, opts.Checkpoint, res)
		case "e2e":
			err = e2e(ctx, e, sz.E2E, res)
		case "purge":
			err = purge(ctx, e, sz.Purge, res)
		case "experiments":
			err = experiments(ctx, e, sz.Overhead, res)
		case "relay":
			err = relay(ctx, e, relaySizes(sz.Name), res)
		case "memory":
			err = memory(ctx, e, sz.Memory, sz.E2E.HeadConsumers, sz.E2E.HeadPrefetch, res)
		case "counts":
			err = counts(ctx, e, sz.Counts, res)
		default:
			err = fmt.Errorf("bench: unknown part %q", p)
		}
		if err != nil {
			return res, fmt.Errorf("%s: %w", p, err)
		}
		fmt.Fprintf(opts.Log, "== %s done in %s\n", p, time.Since(start).Round(100*time.Millisecond))
	}
	return res, nil
}

// ParseParts parses a comma-separated list of parts ("" or "all": every part).
func ParseParts(s string) ([]string, error) { return parseParts(s) }

func machine(ctx context.Context, e *env) [][2]string {
	out := [][2]string{
		{"date", time.Now().UTC().Format(time.RFC3339)},
		{"go", runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH},
		{"cpus", fmt.Sprint(runtime.NumCPU())},
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(l, "MemTotal:"); ok {
				out = append(out, [2]string{"memory", strings.TrimSpace(rest)})
			}
		}
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		out = append(out, [2]string{"load average", strings.Join(strings.Fields(string(b))[:3], " ") + " (at start)"})
	}
	info := e.serverInfo(ctx)
	for _, k := range []string{"pg_server_version", "pg_synchronous_commit", "pg_fsync", "pg_shared_buffers", "pg_autovacuum", "rabbitmq_version"} {
		if v, ok := info[k]; ok {
			out = append(out, [2]string{strings.TrimPrefix(k, "pg_"), v})
		}
	}
	return out
}
