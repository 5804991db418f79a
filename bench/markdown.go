package bench

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"
)

// LoadAverage is the 1-minute load average (NaN where /proc is absent).
func LoadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return math.NaN()
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return math.NaN()
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return math.NaN()
	}
	return v
}

const notesHeading = "## Notes"

// WriteMarkdown writes the result as a RESULTS.md: the run's facts, the
// command, the printed tables and the JSON line. loadStart and loadEnd are
// the 1-minute load averages around the run; above 1.0 the file says that
// the machine was loaded. A "## Notes" section of an existing file is kept.
func (r *Result) WriteMarkdown(path, command string, took time.Duration, loadStart, loadEnd float64) error {
	var out bytes.Buffer
	r.Print(&out)
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Benchmark results (%s run)\n\n", r.Profile)
	fmt.Fprintf(&b, "Written by the benchmark command itself; see `bench/doc.go` for how each figure is measured.\n\n")
	for _, kv := range r.Machine {
		fmt.Fprintf(&b, "- %s: %s\n", kv[0], kv[1])
	}
	fmt.Fprintf(&b, "- command: `%s`\n", command)
	fmt.Fprintf(&b, "- duration: %s\n", took.Round(time.Second))
	fmt.Fprintf(&b, "- load average (1 min): %.2f before the run, %.2f at its end (the latter includes the benchmark's own last part)\n\n", loadStart, loadEnd)
	if loadStart > 1.0 {
		fmt.Fprintf(&b, "**The machine was loaded when this run started** (load average above 1.0 on a shared machine). "+
			"Ratios come from variants interleaved in one process and are the figures to read; absolute rates and latencies are lower and noisier than on an idle machine.\n\n")
	}
	b.WriteString("## Issue 25 targets, measured value and floor\n\n")
	b.WriteString("Rate ratios are medians of per-round ratios (interleaved rounds); the spread is their min–max and interquartile range over the rounds. " +
		"A ratio whose rounds straddle its target is noise, not a result.\n\n")
	b.WriteString(r.TargetsMarkdown())
	b.WriteString("\n## Output\n\n")
	b.WriteString("```text\n")
	b.Write(bytes.TrimLeft(out.Bytes(), "\n"))
	b.WriteString("```\n")
	// Hand-written notes (from a "## Notes" heading on) survive a rerun.
	if old, err := os.ReadFile(path); err == nil {
		if i := bytes.Index(old, []byte("\n"+notesHeading)); i >= 0 {
			b.WriteString("\n")
			b.Write(old[i+1:])
		}
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}
