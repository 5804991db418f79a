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
	spreads map[string]spread
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

// setRatio sets key to the median of the per-round ratios xs and records
// their spread: key_min, key_max and key_iqr (Q3 − Q1) in the JSON, and
// "min–max (IQR …)" beside the median in the tables of targets. A reader
// compares the spread with the distance to a target: a ratio whose rounds
// straddle the target is noise, not a result.
func (r *Result) setRatio(key string, xs []float64) {
	sp := spreadOf(xs)
	if r.spreads == nil {
		r.spreads = map[string]spread{}
	}
	r.spreads[key] = sp
	r.set(key, sp.med)
	r.set(key+"_min", sp.min)
	r.set(key+"_max", sp.max)
	r.set(key+"_iqr", sp.q3-sp.q1)
}

// Spread returns the per-round spread recorded by setRatio for key:
// min, max, the quartiles and the number of rounds (ok false when key is not
// a per-round ratio of this run).
func (r *Result) Spread(key string) (min, q1, q3, max float64, rounds int, ok bool) {
	sp, ok := r.spreads[key]
	return sp.min, sp.q1, sp.q3, sp.max, sp.n, ok
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

// target is one figure of an issue with its bound.
type target struct {
	key   string
	le    bool // true: value ≤ bound; false: value ≥ bound
	bound float64
	// what the figure is, for the markdown table of issue 25 ("" : the key).
	what string
	// floor, when set, is the floor to show beside the figure: what the
	// issue gives and what this run measured that bounds it ("" : none).
	floor func(r *Result) string
}

var targets = []target{
	{key: "claim_overhead_ratio", bound: 0.90},
	{key: "claim_overhead_ratio_3stmt", bound: 0.95},
	{key: "vs_naive_ratio", bound: 1.2},
	{key: "vs_separate_tx_ratio", bound: 1.5},
	{key: "e2e_ratio", bound: 0.95},
	{key: "duplicate_speedup", bound: 3},
	{key: "growth_p99_ratio_v7", le: true, bound: 1.25},
	{key: "purge_p99_ratio", le: true, bound: 3.0},
	{key: "purge_worst_ms", le: true, bound: 100},
}

// targets25 are issue 25's bounds (a claim that costs what the guarantee
// costs), shown side by side in one table with the floor where the issue
// measured one. Counts (instructions, WAL, allocations) bind; rate ratios
// are read on a quiet machine only.
var targets25 = []target{
	{key: "server_instructions_per_claim", le: true, bound: 65000, what: "server instructions added by the claim (ours − no dedup; stretch ≤ 58k)",
		floor: func(r *Result) string {
			get := func(v string) (string, bool) {
				x, ok := r.values["server_instructions_per_claim_"+v]
				return fmtVal(x), ok && !math.IsNaN(x)
			}
			mech, ok1 := get(vFloorMechanism)
			checked, ok2 := get(vFloorChecked)
			lean, ok3 := get(vFloorLean)
			today, ok4 := get(vFloorToday)
			checkedS, ok5 := get(vFloorCheckedSession)
			leanS, ok6 := get(vFloorLeanSession)
			todayS, ok7 := get(vFloorTodaySession)
			if !ok1 || !ok2 || !ok3 || !ok4 || !ok5 || !ok6 || !ok7 {
				return "50.4k the mechanism alone (issue 25's figure: uuid-only INSERT … ON CONFLICT DO NOTHING sent with BEGIN)"
			}
			return "this run, the statement alone (bench/floors.go): " + mech + " the mechanism (uuid-only INSERT … ON CONFLICT DO NOTHING sent with BEGIN); " +
				checked + " a table per consumer (uuid, fingerprint) with every check; " + lean + " issue 25's lean row (int2 consumer, no secondary index) with every check; " + today + " the table's statement (the previous release's); with the lock bound per session only (no backstop in the statement): " +
				checkedS + ", " + leanS + " and " + todayS + " for the same three"
		}},
	{key: "client_instructions_per_claim", le: true, bound: 8000, what: "client instructions added by the claim (ours − no dedup: the same router layers, a plain pgx transaction)",
		floor: func(r *Result) string {
			v, ok := r.values["client_instructions_over_plain_tx"]
			if !ok || math.IsNaN(v) {
				return ""
			}
			return fmtVal(v) + " over the handler in pgx's own transaction without the chain's layers (plain_tx)"
		}},
	{key: "wal_bytes_per_claim", le: true, bound: 250, what: "WAL bytes added by the claim"},
	{key: "allocs_ratio_chain", le: true, bound: 1.2, what: "client allocations ÷ a plain pgx transaction (through the chain)"},
	{key: "duplicate_cpu_ratio", le: true, bound: 0.5, what: "duplicate in a run of duplicates (a replay), instructions (client + server) ÷ a new message's",
		floor: func(r *Result) string {
			iso, ok := r.values["duplicate_cpu_ratio_isolated"]
			v, ok2 := r.values["duplicate_cpu_ratio_no_lock_timeout_no_verify"]
			if !ok || !ok2 || math.IsNaN(iso) || math.IsNaN(v) {
				return ""
			}
			return "one autocommit read of the row; a duplicate outside a run (among new events) " + fmtVal(iso) + ", over the floor " + fmtVal(v) + " of BEGIN + claim + ROLLBACK alone"
		}},
	{key: "duplicate_cpu_ratio_redelivered", le: true, bound: 0.5, what: "a duplicate the broker marks as redelivered (AMQP, JetStream, Redis Streams with CountingClient), with the crash bound NewConsumer sets: instructions ÷ a new message's",
		floor: func(*Result) string {
			return "one read-only autocommit statement: the duplicate path's read of the processed row"
		}},
	{key: "claim_overhead_ratio", bound: 0.90, what: "claim, one-INSERT handler (rate ÷ no dedup, 4 workers)",
		floor: func(r *Result) string {
			return "the mechanism alone (floor_mechanism: a uuid-only INSERT … ON CONFLICT DO NOTHING sent with BEGIN) " +
				r.valueWithSpread("floor_mechanism_overhead_ratio") + ", in-memory Deduplicator " + r.valueWithSpread("inmemory_overhead_ratio") + " (this run)"
		}},
	{key: "claim_overhead_ratio_3stmt", bound: 0.93, what: "three-statement handler (rate ÷ no dedup, 4 workers)",
		floor: func(r *Result) string {
			if _, ok := r.values["inmemory_overhead_ratio_3stmt"]; !ok {
				return ""
			}
			floor := ""
			if _, ok := r.values["floor_mechanism_overhead_ratio_3stmt"]; ok {
				floor = "the mechanism alone " + r.valueWithSpread("floor_mechanism_overhead_ratio_3stmt") + ", "
			}
			return floor + "in-memory Deduplicator " + r.valueWithSpread("inmemory_overhead_ratio_3stmt") + " (this run)"
		}},
	{key: "e2e_ratio", bound: 0.93, what: "end to end over RabbitMQ (rate ÷ no dedup)", floor: e2eFloor("")},
	{key: "e2e_ratio_jetstream", bound: 0.93, what: "end to end over NATS JetStream (rate ÷ no dedup)", floor: e2eFloor("_jetstream")},
}

// e2eFloor is the floor of e2e_ratio<suffix>: the bare claim row end to
// end in the same rounds ("" when not measured).
func e2eFloor(suffix string) func(*Result) string {
	return func(r *Result) string {
		if _, ok := r.values["e2e_floor_mechanism_ratio"+suffix]; !ok {
			return ""
		}
		return "the mechanism alone (floor_mechanism) " + r.valueWithSpread("e2e_floor_mechanism_ratio"+suffix) + " (this run)"
	}
}

// valueWithSpread is key's value, with " (min–max)" when it is a per-round
// ratio; "-" when not measured.
func (r *Result) valueWithSpread(key string) string {
	v, ok := r.values[key]
	if !ok || math.IsNaN(v) {
		return "-"
	}
	if sp, ok := r.spreads[key]; ok && sp.n > 0 {
		return fmtVal(v) + " (" + sp.short() + ")"
	}
	return fmtVal(v)
}

func (r *Result) printTargets(w io.Writer) {
	r.printTargetList(w, "-- targets (issue 7)", targets)
	fmt.Fprintln(w)
	r.printTargetList(w, "-- targets (issue 25; counts from part 6 bind; spread: per-round ratios min–max and interquartile range)", targets25)
}

// check evaluates t on this run: the value (NaN if missing), its spread
// text ("" if not a per-round ratio), the bound text and met (yes/no/n/a).
func (r *Result) check(t target) (v float64, spreadText, bound, met string) {
	v, ok := r.values[t.key]
	if !ok {
		v = math.NaN()
	}
	op := "≥"
	if t.le {
		op = "≤"
	}
	met = "no"
	switch {
	case !ok || math.IsNaN(v):
		met = "n/a"
	case t.le && v <= t.bound, !t.le && v >= t.bound:
		met = "yes"
	}
	if sp, ok := r.spreads[t.key]; ok {
		spreadText = sp.String()
	}
	b := strconv.FormatFloat(t.bound, 'g', -1, 64)
	if t.bound >= 1000 {
		b = strconv.FormatFloat(t.bound/1000, 'g', -1, 64) + "k"
	}
	return v, spreadText, op + " " + b, met
}

func (r *Result) printTargetList(w io.Writer, title string, targets []target) {
	fmt.Fprintln(w, title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	withFloor := false
	for _, t := range targets {
		withFloor = withFloor || t.floor != nil
	}
	if withFloor {
		fmt.Fprintln(tw, "key\tvalue\tspread over rounds\ttarget\tmet\tfloor\t")
	} else {
		fmt.Fprintln(tw, "key\tvalue\tspread over rounds\ttarget\tmet\t")
	}
	for _, t := range targets {
		v, sp, bound, met := r.check(t)
		if sp == "" {
			sp = "-"
		}
		if withFloor {
			floor := ""
			if t.floor != nil {
				floor = t.floor(r)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", t.key, fmtVal(v), sp, bound, met, floor)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t\n", t.key, fmtVal(v), sp, bound, met)
	}
	_ = tw.Flush()
}

// TargetsMarkdown is issue 25's targets as one markdown table: per target
// what it measures, the measured value (median over rounds for a rate
// ratio), the spread over rounds, the target, whether it is met and the
// floor beside it (the floors; the in-memory Deduplicator measured in
// the same run). It is what the README's performance section takes.
func (r *Result) TargetsMarkdown() string {
	var b strings.Builder
	b.WriteString("| issue 25 target | key | measured | spread over rounds (min–max, IQR) | target | met | floor |\n")
	b.WriteString("| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, t := range targets25 {
		v, sp, bound, met := r.check(t)
		floor := ""
		if t.floor != nil {
			floor = t.floor(r)
		}
		what := t.what
		if what == "" {
			what = t.key
		}
		if sp == "" {
			sp = "-"
		}
		if floor == "" {
			floor = "-"
		}
		fmt.Fprintf(&b, "| %s | `%s` | %s | %s | %s | %s | %s |\n", what, t.key, fmtVal(v), sp, bound, met, floor)
	}
	return b.String()
}

// fmtVal formats a value: 3 decimals below 100 (ratios), "107.3k" from
// 10,000 on (instruction counts), no decimals between; "-" for NaN.
func fmtVal(v float64) string {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		return "-"
	case math.Abs(v) >= 10000:
		return strconv.FormatFloat(v/1000, 'f', 1, 64) + "k"
	case math.Abs(v) >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return f3(v)
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
