package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
)

// RequiredKeys are the keys every run's JSON line carries (issue 7).
var RequiredKeys = []string{
	"claim_overhead_ratio",
	"claim_overhead_ratio_3stmt",
	"vs_naive_ratio",
	"vs_separate_tx_ratio",
	"vs_inmemory_ratio",
	"duplicate_speedup",
	"e2e_ratio",
	"growth_p99_ratio_v7",
	"purge_p99_ratio",
	"purge_worst_ms",
	"allocs_per_msg",
}

// Result is one run: the tables printed and the JSON values.
type Result struct {
	Profile string
	Machine [][2]string
	Tables  []Table
	keys    []string
	values  map[string]float64
}

// Table is one printed table.
type Table struct {
	Title  string
	Header []string
	Rows   [][]string
	Notes  []string
}

func (r *Result) set(key string, v float64) {
	if r.values == nil {
		r.values = map[string]float64{}
	}
	if _, ok := r.values[key]; !ok {
		r.keys = append(r.keys, key)
	}
	r.values[key] = v
}

// Value returns the JSON value of key.
func (r *Result) Value(key string) (float64, bool) {
	v, ok := r.values[key]
	return v, ok
}

// JSON is the one-line JSON object: the required keys first, then the
// others in the order they were measured; values rounded to 4 significant
// digits; a non-finite value (a part that measured nothing) is null.
func (r *Result) JSON() []byte {
	keys := append([]string{}, RequiredKeys...)
	for _, k := range r.keys {
		if !contains(keys, k) {
			keys = append(keys, k)
		}
	}
	var b bytes.Buffer
	b.WriteString(`{"profile":`)
	q, _ := json.Marshal(r.Profile)
	b.Write(q)
	for _, k := range keys {
		b.WriteString(`,"` + k + `":`)
		v, ok := r.values[k]
		if !ok || math.IsNaN(v) || math.IsInf(v, 0) {
			b.WriteString("null")
			continue
		}
		b.WriteString(strconv.FormatFloat(round4(v), 'g', -1, 64))
	}
	b.WriteString("}")
	return b.Bytes()
}

func round4(v float64) float64 {
	if v == 0 {
		return 0
	}
	f, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 4, 64), 64)
	return f
}

func contains(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// Print writes the machine, the tables, then the JSON line, last.
func (r *Result) Print(w io.Writer) {
	fmt.Fprintf(w, "\n== watermill-idempotency benchmarks (%s) ==\n", r.Profile)
	for _, kv := range r.Machine {
		fmt.Fprintf(w, "%-20s %s\n", kv[0], kv[1])
	}
	for _, t := range r.Tables {
		fmt.Fprintf(w, "\n-- %s\n", t.Title)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, strings.Join(t.Header, "\t")+"\t")
		for _, row := range t.Rows {
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		_ = tw.Flush()
		for _, n := range t.Notes {
			fmt.Fprintf(w, "   %s\n", n)
		}
	}
	fmt.Fprintln(w)
	r.printTargets(w)
	fmt.Fprintln(w)
	w.Write(r.JSON())
	fmt.Fprintln(w)
}

// target is one ratio of issue 7 with its bound.
type target struct {
	key   string
	le    bool // true: value ≤ bound; false: value ≥ bound
	bound float64
}

var targets = []target{
	{"claim_overhead_ratio", false, 0.90},
	{"claim_overhead_ratio_3stmt", false, 0.95},
	{"vs_naive_ratio", false, 1.2},
	{"vs_separate_tx_ratio", false, 1.5},
	{"e2e_ratio", false, 0.95},
	{"duplicate_speedup", false, 3},
	{"growth_p99_ratio_v7", true, 1.25},
	{"purge_p99_ratio", true, 3.0},
	{"purge_worst_ms", true, 100},
}

// targets17 are issue 17's bounds (performance to the floor).
var targets17 = []target{
	{"claim_overhead_ratio", false, 0.92},
	{"claim_overhead_ratio_3stmt", false, 0.96},
	{"e2e_ratio", false, 0.95},
	{"duplicate_cpu_ratio", true, 0.5},
	{"server_instructions_per_claim", true, 50000},
	{"allocs_ratio_chain", true, 2},
}

func (r *Result) printTargets(w io.Writer) {
	r.printTargetList(w, "-- targets (issue 7)", targets)
	fmt.Fprintln(w)
	r.printTargetList(w, "-- targets (issue 17; counts from part 6)", targets17)
}

func (r *Result) printTargetList(w io.Writer, title string, targets []target) {
	fmt.Fprintln(w, title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "key\tvalue\ttarget\tmet\t")
	for _, t := range targets {
		v, ok := r.values[t.key]
		if !ok {
			v = math.NaN()
		}
		op := "≥"
		if t.le {
			op = "≤"
		}
		met := "no"
		switch {
		case !ok || math.IsNaN(v):
			met = "n/a"
		case t.le && v <= t.bound, !t.le && v >= t.bound:
			met = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s %g\t%s\t\n", t.key, f3(v), op, t.bound, met)
	}
	_ = tw.Flush()
}

func f3(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 3, 64)
}

func f0(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func f1(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 1, 64)
}
