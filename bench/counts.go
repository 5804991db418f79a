package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Part "counts": per message on the one-INSERT handler through the
// recommended chain, one worker, counts that other load cannot move:
//
//   - client instructions: the benchmark re-executes itself as a child
//     process (countChildEnv) under valgrind's cachegrind (--cache-sim=no:
//     instructions only) and runs N1, then N2 messages; the per-message count
//     is (I(N2) − I(N1)) ÷ (N2 − N1), so process start, connecting and
//     building the chain cancel out. Building the messages is inside (the
//     same for every variant).
//   - server instructions: a scratch PostgreSQL the part starts itself
//     (initdb in a temporary directory, a free loopback port; never the
//     shared server) runs under cachegrind too; each child's backend writes
//     its count when the child disconnects; the same difference per message.
//     server_instructions_per_claim = ours − none (what the claim adds).
//   - WAL bytes: pg_current_wal_lsn() before and after the N2 run's loop.
//   - allocations: runtime.MemStats.Mallocs around the N2 run's loop.
//
// Without valgrind or the PostgreSQL binaries the part reports its keys as
// null and says why.

// Profiling knobs of the counts part, read from the environment (see
// bench/doc.go, "Profiling the counts"):
//   - countsToolEnv=callgrind runs the scratch server under callgrind
//     instead of cachegrind, for inclusive costs per function
//     (callgrind_annotate --inclusive=yes); the totals are the same count;
//   - countsKeepEnv=1 keeps the scratch directory (the children's
//     cachegrind files child_<variant>_<n>.cg, their reports .json with the
//     backend's pid, the server's files cg/cg.<pid>) and logs its path;
//   - countsVariantsEnv, a comma-separated list, counts only those variants
//     (none is always counted, as the baseline); keys of the variants left
//     out are then meaningless.
const (
	countsToolEnv     = "IDEMBENCH_COUNTS_TOOL"
	countsKeepEnv     = "IDEMBENCH_COUNTS_KEEP"
	countsVariantsEnv = "IDEMBENCH_COUNTS_VARIANTS"
)

// countedVariants returns countVariants, or the subset countsVariantsEnv
// names (with none first).
func countedVariants() []string {
	only := os.Getenv(countsVariantsEnv)
	if only == "" {
		return countVariants
	}
	want := map[string]bool{vNone: true}
	for _, v := range strings.Split(only, ",") {
		want[strings.TrimSpace(v)] = true
	}
	var out []string
	for _, v := range countVariants {
		if want[v] {
			out = append(out, v)
		}
	}
	return out
}

// countChildEnv carries a child's countSpec (JSON); see RunCountChild.
const countChildEnv = "IDEMBENCH_COUNT_CHILD"

type countSpec struct {
	URL     string `json:"url"`
	Schema  string `json:"schema"`
	Variant string `json:"variant"`
	N       int    `json:"n"`
	IDsFile string `json:"ids_file,omitempty"` // duplicate variant: processed ids, one a line
	Out     string `json:"out"`                // the child writes its countReport here
}

type countReport struct {
	PID uint32 `json:"pid"` // the backend's pid
	WAL int64  `json:"wal"` // bytes of WAL during the loop
	// WALWrites: pg_stat_wal.wal_write during the loop, the server's WAL
	// writes (each commit's flush is one; the scratch server runs nothing
	// else but the WAL writer), for "one WAL flush per message".
	WALWrites int64   `json:"wal_writes"`
	Allocs    float64 `json:"allocs"` // per message
	Bytes     float64 `json:"bytes"`  // per message
}

// RunCountChild runs the counts part's child when the process was started
// as one (the environment variable countChildEnv set) and exits; otherwise
// it returns at once. The benchmark command calls it first thing.
func RunCountChild() {
	spec := os.Getenv(countChildEnv)
	if spec == "" {
		return
	}
	if err := countChild(spec); err != nil {
		fmt.Fprintln(os.Stderr, "idembench count child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func countChild(specJSON string) error {
	var s countSpec
	if err := json.Unmarshal([]byte(specJSON), &s); err != nil {
		return err
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(s.URL)
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = s.Schema
	cfg.MaxConns, cfg.MinConns = 1, 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := processedstore.NewStore(processedstore.Config{Table: s.Schema + ".processed_event", Horizon: time.Hour})
	if err != nil {
		return err
	}
	// As NewConsumer: the lean claim, and the UUIDv7 claim table.
	if err := store.CheckLean(ctx, sqldb.Pgx(pool), consumerName); err != nil {
		return err
	}
	vs, err := newVariantSet(pool, store)
	if err != nil {
		return err
	}
	var ids []uuid.UUID
	if s.IDsFile != "" {
		b, err := os.ReadFile(s.IDsFile)
		if err != nil {
			return err
		}
		for _, l := range strings.Fields(string(b)) {
			ids = append(ids, uuid.MustParse(l))
		}
	}
	msgs := make([]*message.Message, s.N)
	for i := range msgs {
		var m *message.Message
		if ids != nil {
			m, err = marshaler.NewMessageWithID(ids[i%len(ids)], eventName, time.Now().UTC(), payload())
		} else {
			m, err = newV7()
		}
		if err != nil {
			return err
		}
		if countMarked[s.Variant] {
			// A first delivery as AMQP and JetStream mark it.
			marshaler.SetRedelivered(m, false)
			marshaler.SetDeliveryCount(m, 0)
		}
		if s.Variant == vDupRedelivered {
			// A redelivery as AMQP and JetStream mark it.
			marshaler.SetRedelivered(m, true)
			marshaler.SetDeliveryCount(m, 1)
		}
		m.SetContext(ctx)
		msgs[i] = m
	}
	v := s.Variant
	h := vs.handlerFor(v, handler(h1)) // none, idempotent, duplicate (vs.handlerFor: ours)
	if v == vPlainTx {
		h = txMiddleware(pool)(handler(h1))
	}
	// q runs the child's own queries on the backend the loop uses.
	var q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	} = pool
	if isFloor(v) {
		// A floor holds the pool's one connection for the whole run.
		c, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer c.Release()
		if h, err = floorHandler(ctx, c.Conn(), v, handler(h1)); err != nil {
			return err
		}
		q = c.Conn()
	}
	if mod, ok := countConfigs[v]; ok {
		beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
		if err != nil {
			return err
		}
		cfg := inbox.Config{Beginner: beginner, Store: store, Consumer: consumerName, Recorder: vs.sink}
		mod(&cfg)
		if cfg.MaxCrashes > 0 {
			cfg.CrashQuerier = inbox.OwnQuerier(beginner, sqldb.PgxIn(pool, sqldb.OwnMode(pool))) // as NewConsumer sets it
		}
		idem, err := inbox.NewIdempotent(cfg, watermill.NopLogger{})
		if err != nil {
			return err
		}
		chain, _, err := chainWith(idem)
		if err != nil {
			return err
		}
		h = compose(handler(h1), chain...)
	}
	var rep countReport
	var lsn0 string
	var writes0 int64
	if err := q.QueryRow(ctx, "SELECT pg_backend_pid(), pg_current_wal_insert_lsn()::text, (SELECT wal_write FROM pg_stat_wal)").Scan(&rep.PID, &lsn0, &writes0); err != nil {
		return err
	}
	// The collector is off during the loop and collects once after it:
	// where its cycles fell inside the loop moved the client's count by
	// ±5k a message between runs; one collection of all the loop's garbage
	// charges every variant the sweep of what it allocated, the same way
	// each run.
	runtime.GC()
	gcPercent := debug.SetGCPercent(-1)
	var a, b runtime.MemStats
	runtime.ReadMemStats(&a)
	for _, m := range msgs {
		if _, err := h(m); err != nil {
			return err
		}
	}
	runtime.ReadMemStats(&b)
	runtime.GC()
	debug.SetGCPercent(gcPercent)
	if err := q.QueryRow(ctx, "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint, (SELECT wal_write FROM pg_stat_wal) - $2", lsn0, writes0).Scan(&rep.WAL, &rep.WALWrites); err != nil {
		return err
	}
	n := float64(s.N)
	rep.Allocs = float64(b.Mallocs-a.Mallocs) / n
	rep.Bytes = float64(b.TotalAlloc-a.TotalAlloc) / n
	out, err := json.Marshal(rep)
	if err != nil {
		return err
	}
	return os.WriteFile(s.Out, out, 0o644)
}

// CountSizes sizes the counts part: N1 and N2 messages per child (0: the
// part is skipped).
type CountSizes struct {
	N1, N2 int
}

// countVariants are the variants counted, the first the baseline.
var countVariants = []string{vNone, vOurs, vDuplicate, "idem_no_lock_timeout", "idem_no_verify", "dup_no_lock_timeout_no_verify", vPlainTx,
	"idem_crash_bound_marked", "idem_crash_bound_unmarked", vDupRedelivered, vDupIsolated,
	vFloorNone, vFloorMechanism, vFloorChecked, vFloorLean, vFloorToday, vFloorCheckedSession, vFloorLeanSession, vFloorTodaySession}

// vDupRedelivered is a duplicate as a broker redelivers it (redelivered
// "true", delivery count 1) to a consumer with the crash bound NewConsumer
// sets: the event's processed row is found by one read-only statement,
// and no transaction is begun.
const vDupRedelivered = "dup_redelivered"

// vDupIsolated is a duplicate outside a run of duplicates (a middleware
// without the querier that reads them first): BEGIN, the claim, the
// identity read and ROLLBACK, what a duplicate among new events costs.
const vDupIsolated = "dup_isolated"

// vPlainTx is the handler in a plain pgx transaction without the chain
// (none has the chain's outer layers): what a router without this library
// runs; the consumer's whole cost is idempotent − plain_tx.
const vPlainTx = "plain_tx"

// countMarked are the variants whose messages are marked as first
// deliveries (redelivered "false", delivery count 0), as AMQP and JetStream
// deliver them.
var countMarked = map[string]bool{"idem_crash_bound_marked": true}

// countConfigs are the counted configurations of the middleware other than
// the default: where its cost goes.
var countConfigs = map[string]func(*inbox.Config){
	// Config.LockTimeout < 0: no SET LOCAL lock_timeout in the batch (the
	// pool's sessions would carry lock_timeout instead).
	"idem_no_lock_timeout": func(c *inbox.Config) { c.LockTimeout = -1 },
	// Config.DisablePayloadVerification: no fingerprint, no identity read.
	"idem_no_verify": func(c *inbox.Config) { c.DisablePayloadVerification = true },
	// A duplicate with neither: BEGIN, claim, ROLLBACK only.
	"dup_no_lock_timeout_no_verify": func(c *inbox.Config) {
		c.LockTimeout, c.DisablePayloadVerification = -1, true
	},
	// The crash bound as NewConsumer sets it (ConsumerConfig.MaxCrashes,
	// counted on the pool): on first deliveries a transport marks (AMQP,
	// JetStream, Redis Streams with CountingClient) nothing is written;
	// unmarked (Kafka) the first 64 attempts of each child are counted, and
	// the N2 − N1 difference is what follows them.
	"idem_crash_bound_marked":   func(c *inbox.Config) { c.MaxCrashes = 3 },
	"idem_crash_bound_unmarked": func(c *inbox.Config) { c.MaxCrashes = 3 },
	vDupRedelivered:             func(c *inbox.Config) { c.MaxCrashes = 3 },
	vDupIsolated:                func(*inbox.Config) {}, // no CrashQuerier: no run's read
}

type countResult struct {
	client, server float64 // instructions per message
	wal            float64 // bytes per message
	walWrites      float64 // WAL writes per message
	allocs, bytes  float64 // per message (N2 run)
}

func counts(ctx context.Context, e *env, sz CountSizes, res *Result) error {
	keys := []string{"server_instructions_per_claim", "client_instructions_per_claim", "wal_bytes_per_claim",
		"client_instructions_per_msg", "client_instructions_per_msg_plain",
		"server_instructions_per_msg", "server_instructions_per_msg_plain", "duplicate_cpu_ratio"}
	skip := func(why string) error {
		for _, k := range keys {
			res.set(k, math.NaN())
		}
		res.Tables = append(res.Tables, Table{Title: "6. counts: not measured", Header: []string{"why"}, Rows: [][]string{{why}}})
		fmt.Fprintf(e.log, "counts: skipped: %s\n", why)
		return nil
	}
	if sz.N2 <= sz.N1 || sz.N1 <= 0 {
		return skip("no sizes in this profile")
	}
	valgrind, err := exec.LookPath("valgrind")
	if err != nil {
		return skip("valgrind not found (apt-get install valgrind)")
	}
	self, err := os.Executable()
	if err != nil {
		return skip(err.Error())
	}
	srv, err := startScratch(ctx, valgrind)
	if err != nil {
		return fmt.Errorf("bench: counts: scratch PostgreSQL: %w", err)
	}
	defer srv.stop()
	fmt.Fprintf(e.log, "counts: scratch PostgreSQL under %s on port %d\n", srv.tool, srv.port)
	if os.Getenv(countsKeepEnv) != "" {
		fmt.Fprintf(e.log, "counts: keeping %s\n", srv.dir)
	}

	setup, err := pgx.Connect(ctx, srv.url)
	if err != nil {
		return err
	}
	const schema = "counts"
	if _, err := setup.Exec(ctx, "CREATE SCHEMA "+schema+"; SET search_path = "+schema+";"+handlerSchema+floorSchema); err != nil {
		setup.Close(ctx)
		return err
	}
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	if err == nil {
		err = store.Migrate(ctx, sqldb.Pgx(setup))
	}
	if err == nil {
		_, err = setup.Exec(ctx, floorTodaySchema)
	}
	if err != nil {
		setup.Close(ctx)
		return err
	}
	// Already-processed ids for the duplicate variant.
	var idb bytes.Buffer
	for i := 0; i < sz.N2; i++ {
		id, _ := uuid.NewV7()
		if _, err := store.Claim(ctx, sqldb.Pgx(setup), consumerName, id); err != nil {
			setup.Close(ctx)
			return err
		}
		idb.WriteString(id.String() + "\n")
	}
	setup.Close(ctx)
	idsFile := filepath.Join(srv.dir, "dup_ids")
	if err := os.WriteFile(idsFile, idb.Bytes(), 0o644); err != nil {
		return err
	}

	run := func(v string, n int) (client, server int64, rep countReport, err error) {
		out := filepath.Join(srv.dir, fmt.Sprintf("child_%s_%d", v, n))
		spec := countSpec{URL: srv.url, Schema: schema, Variant: v, N: n, Out: out + ".json"}
		if strings.HasPrefix(v, "dup") {
			spec.IDsFile = idsFile
		}
		sj, _ := json.Marshal(spec)
		cmd := exec.CommandContext(ctx, valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file="+out+".cg", self)
		// GOMAXPROCS=1: under valgrind one thread runs at a time, and with
		// several Ps the Go scheduler's spinning (findRunnable, lock2,
		// goschedImpl) was counted as client work: one child in a few
		// measured 190–410k instead of ~60k client instructions per
		// message. With one P the client counts repeat to ±0.3k.
		cmd.Env = append(os.Environ(), countChildEnv+"="+string(sj), "GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off", "GOMAXPROCS=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return 0, 0, rep, fmt.Errorf("child %s n=%d: %w\n%s", v, n, err, tail(stderr.String(), 2000))
		}
		if client, err = cgSummary(out + ".cg"); err != nil {
			return 0, 0, rep, err
		}
		b, err := os.ReadFile(out + ".json")
		if err != nil {
			return 0, 0, rep, err
		}
		if err := json.Unmarshal(b, &rep); err != nil {
			return 0, 0, rep, err
		}
		// The backend writes its count when it exits, after the child
		// disconnected.
		sf := filepath.Join(srv.dir, "cg", fmt.Sprintf("cg.%d", rep.PID))
		deadline := time.Now().Add(60 * time.Second)
		for {
			if server, err = cgSummary(sf); err == nil {
				break
			}
			if time.Now().After(deadline) {
				return 0, 0, rep, fmt.Errorf("backend %d wrote no count: %w", rep.PID, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		return client, server, rep, nil
	}
	got := map[string]countResult{}
	variants := countedVariants()
	for _, v := range variants {
		fmt.Fprintf(e.log, "counts: %s (%d and %d messages)\n", v, sz.N1, sz.N2)
		c1, s1, _, err := run(v, sz.N1)
		if err != nil {
			return fmt.Errorf("bench: counts: %w", err)
		}
		c2, s2, rep, err := run(v, sz.N2)
		if err != nil {
			return fmt.Errorf("bench: counts: %w", err)
		}
		d := float64(sz.N2 - sz.N1)
		got[v] = countResult{
			client: float64(c2-c1) / d, server: float64(s2-s1) / d,
			wal: float64(rep.WAL) / float64(sz.N2), walWrites: float64(rep.WALWrites) / float64(sz.N2), allocs: rep.Allocs, bytes: rep.Bytes,
		}
	}
	k := func(x float64) string { return f1(x / 1000) }
	t := Table{
		Title:  "6. counts per message (one-INSERT handler through the chain, one worker; instructions from cachegrind, load-independent)",
		Header: []string{"variant", "client kinstr", "server kinstr", "client+server", "× none", "WAL B", "allocs", "bytes"},
	}
	base := got[vNone]
	for _, v := range variants {
		r := got[v]
		t.Rows = append(t.Rows, []string{v, k(r.client), k(r.server), k(r.client + r.server),
			f3((r.client + r.server) / (base.client + base.server)), f0(r.wal), f1(r.allocs), f0(r.bytes)})
	}
	ours, dup := got[vOurs], got[vDuplicate]
	t.Notes = []string{
		"plain_tx: the handler in pgx's own transaction, no chain (none has the chain's poison, retry and recoverer layers). idem_no_lock_timeout: Config.LockTimeout < 0 (no SET LOCAL); idem_no_verify: DisablePayloadVerification (no fingerprint, no identity read on a duplicate); dup_no_lock_timeout_no_verify: a duplicate with neither (BEGIN, claim, ROLLBACK).",
		"floor_*: the claim's mechanism priced alone, on the same server in the same run (bench/floors.go): BEGIN and one prepared claim statement in a batch, the handler, COMMIT; floor_none sends BEGIN alone. floor_mechanism: uuid-only INSERT … ON CONFLICT DO NOTHING; floor_checked: a table per consumer (uuid, fingerprint) with today's checks (the lock bound in the statement as the middleware sends it, the session's lock_timeout already equal to it; the replay window); floor_lean: issue 25's lean row (int2 consumer, uuid, fingerprint, no secondary index) with today's checks; floor_today: the middleware's statement for a UUIDv7 event on a copy of today's table; *_session: the same with the lock bound per session only (no backstop in the statement).",
		fmt.Sprintf("server instructions per claim, floors (variant − floor_none): mechanism %s k; with every check (per session only): a table per consumer %s k (%s k), lean row %s k (%s k), the table's statement (the previous release's) %s k (%s k).", k(got[vFloorMechanism].server-got[vFloorNone].server),
			k(got[vFloorChecked].server-got[vFloorNone].server), k(got[vFloorCheckedSession].server-got[vFloorNone].server),
			k(got[vFloorLean].server-got[vFloorNone].server), k(got[vFloorLeanSession].server-got[vFloorNone].server),
			k(got[vFloorToday].server-got[vFloorNone].server), k(got[vFloorTodaySession].server-got[vFloorNone].server)),
		"duplicate: ours fed only events already processed, in a run of duplicates (a replay): after the first dozen, each is one autocommit read of its row (inbox duplicaterun.go); dup_isolated: a duplicate outside a run (BEGIN, claim, identity read, ROLLBACK).",
		"dup_redelivered: a duplicate marked as a redelivery (redelivered, delivery count 1), crash bound on: one read-only autocommit statement reads the processed row, nothing is counted, no transaction.",
		"idem_crash_bound_marked / _unmarked: ours with the crash bound NewConsumer sets (MaxCrashes 3, counted on the pool), on first deliveries marked as such (AMQP, JetStream, Redis Streams with CountingClient: nothing written) or unmarked (Kafka: each child's first 64 attempts are counted, inside both runs, so they cancel out of the per-message figure).",
		fmt.Sprintf("(I(%d) − I(%d)) ÷ %d per message: process start and connection cancel out; building the message is inside (same for all).", sz.N2, sz.N1, sz.N2-sz.N1),
		"server: a scratch PostgreSQL (initdb, loopback, fsync off) run by this part under cachegrind, the child's backend only; WAL: pg_current_wal_insert_lsn diff; allocs: MemStats.Mallocs.",
		fmt.Sprintf("server instructions per claim (ours − none): %s k; duplicate CPU ÷ new message CPU: %s.", k(ours.server-base.server), f3((dup.client+dup.server)/(ours.client+ours.server))),
		fmt.Sprintf("WAL writes per message (pg_stat_wal.wal_write, a commit's flush is one): none %s, ours %s, duplicate %s.", f3(base.walWrites), f3(ours.walWrites), f3(dup.walWrites)),
	}
	res.Tables = append(res.Tables, t)
	res.set("server_instructions_per_claim", ours.server-base.server)
	res.set("client_instructions_per_msg", ours.client)
	res.set("client_instructions_per_msg_plain", base.client)
	res.set("server_instructions_per_msg", ours.server)
	res.set("server_instructions_per_msg_plain", base.server)
	res.set("client_instructions_per_duplicate", dup.client)
	res.set("server_instructions_per_duplicate", dup.server)
	res.set("duplicate_cpu_ratio", (dup.client+dup.server)/(ours.client+ours.server))
	res.set("client_instructions_per_claim", ours.client-base.client)
	res.set("wal_bytes_per_claim", ours.wal-base.wal)
	res.set("wal_bytes_per_msg", ours.wal)
	res.set("wal_bytes_per_msg_plain", base.wal)
	res.set("wal_writes_per_msg", ours.walWrites)
	res.set("wal_writes_per_msg_plain", base.walWrites)
	res.set("allocs_per_msg_chain", ours.allocs)
	res.set("allocs_per_msg_chain_plain", base.allocs)
	res.set("allocs_ratio_chain", ours.allocs/base.allocs)
	plain := got[vPlainTx]
	res.set("client_instructions_per_msg_plain_tx", plain.client)
	res.set("allocs_per_msg_plain_tx_nochain", plain.allocs)
	res.set("allocs_ratio_plain_tx", ours.allocs/plain.allocs)
	res.set("client_instructions_over_plain_tx", ours.client-plain.client)
	res.set("server_instructions_per_msg_no_lock_timeout", got["idem_no_lock_timeout"].server)
	res.set("server_instructions_per_msg_no_verify", got["idem_no_verify"].server)
	res.set("client_instructions_per_msg_no_verify", got["idem_no_verify"].client)
	for _, v := range []string{"idem_crash_bound_marked", "idem_crash_bound_unmarked"} {
		r := got[v]
		res.set(v+"_client_instructions_extra", r.client-ours.client)
		res.set(v+"_server_instructions_extra", r.server-ours.server)
		res.set(v+"_wal_bytes_extra", r.wal-ours.wal)
		res.set(v+"_allocs_extra", r.allocs-ours.allocs)
	}
	redelivered := got[vDupRedelivered]
	res.set("client_instructions_per_duplicate_redelivered", redelivered.client)
	res.set("server_instructions_per_duplicate_redelivered", redelivered.server)
	res.set("duplicate_cpu_ratio_redelivered", (redelivered.client+redelivered.server)/(ours.client+ours.server))
	isolated := got[vDupIsolated]
	res.set("duplicate_cpu_ratio_isolated", (isolated.client+isolated.server)/(ours.client+ours.server))
	fnone := got[vFloorNone]
	for _, v := range []string{vFloorMechanism, vFloorChecked, vFloorLean, vFloorToday, vFloorCheckedSession, vFloorLeanSession, vFloorTodaySession} {
		res.set("server_instructions_per_claim_"+v, got[v].server-fnone.server)
	}
	floor := got["dup_no_lock_timeout_no_verify"]
	res.set("duplicate_cpu_ratio_no_lock_timeout_no_verify", (floor.client+floor.server)/(ours.client+ours.server))
	return nil
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// cgSummary reads the instruction total of a cachegrind or callgrind
// output file (its "summary:" line).
func cgSummary(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "summary:"); ok {
			return strconv.ParseInt(strings.Fields(rest)[0], 10, 64)
		}
	}
	return 0, fmt.Errorf("%s: no summary line", path)
}

// scratch is the counts part's own PostgreSQL server.
type scratch struct {
	dir, url string
	tool     string // cachegrind, or callgrind (countsToolEnv)
	port     int
	cmd      *exec.Cmd
	exited   chan error
}

// startScratch runs initdb in a temporary directory and starts postgres
// under cachegrind (one count file per process, cg/cg.<pid>) on a free
// loopback port. Run as root, the server runs as "postgres" (else
// "nobody"), as PostgreSQL refuses root.
func startScratch(ctx context.Context, valgrind string) (*scratch, error) {
	bin := os.Getenv("PG_BINDIR")
	if bin == "" {
		p, err := exec.LookPath("initdb")
		if err != nil {
			return nil, errors.New("initdb not found (set PG_BINDIR)")
		}
		bin = filepath.Dir(p)
	}
	dir, err := os.MkdirTemp("", "idembench-counts-")
	if err != nil {
		return nil, err
	}
	s := &scratch{dir: dir}
	if err := os.Mkdir(filepath.Join(dir, "cg"), 0o755); err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		var u *user.User
		for _, name := range []string{"postgres", "nobody"} {
			if u, err = user.Lookup(name); err == nil {
				break
			}
		}
		if err != nil {
			return nil, err
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		_ = os.Chmod(dir, 0o755)
		if err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, uid, gid)
		}); err != nil {
			return nil, err
		}
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	env := append(os.Environ(), "LC_ALL=C", "LANG=C")
	var out bytes.Buffer
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", filepath.Join(dir, "data"), "-U", "postgres", "--auth=trust",
		"--no-sync", "--no-instructions", "--encoding=UTF8", "--locale=C")
	initdb.Env, initdb.Dir, initdb.Stdout, initdb.Stderr = env, dir, &out, &out
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if err := initdb.Run(); err != nil {
		s.stop()
		return nil, fmt.Errorf("initdb: %v\n%s", err, out.String())
	}
	l, err := netListenLoopback()
	if err != nil {
		s.stop()
		return nil, err
	}
	s.port = l
	s.url = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		s.stop()
		return nil, err
	}
	defer logf.Close()
	s.tool = "cachegrind"
	args := []string{"--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=" + filepath.Join(dir, "cg", "cg.%p")}
	if os.Getenv(countsToolEnv) == "callgrind" {
		s.tool = "callgrind"
		args = []string{"--tool=callgrind", "--callgrind-out-file=" + filepath.Join(dir, "cg", "cg.%p")}
	}
	args = append(args, "--trace-children=no",
		filepath.Join(bin, "postgres"), "-D", filepath.Join(dir, "data"),
		"-c", "port="+strconv.Itoa(s.port), "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
		"-c", "fsync=off", "-c", "max_connections=20", "-c", "shared_buffers=64MB", "-c", "autovacuum=off",
		"-c", "dynamic_shared_memory_type=posix", "-c", "max_parallel_workers_per_gather=0")
	s.cmd = exec.Command(valgrind, args...)
	s.cmd.Env, s.cmd.Dir, s.cmd.Stdout, s.cmd.Stderr = env, dir, logf, logf
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGQUIT}
	if err := s.cmd.Start(); err != nil {
		s.stop()
		return nil, err
	}
	s.exited = make(chan error, 1)
	go func() { s.exited <- s.cmd.Wait() }()
	deadline := time.Now().Add(120 * time.Second)
	for {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		conn, err := pgx.Connect(c, s.url)
		cancel()
		if err == nil {
			_ = conn.Close(ctx)
			return s, nil
		}
		select {
		case werr := <-s.exited:
			s.exited <- werr
			lg, _ := os.ReadFile(filepath.Join(dir, "log"))
			s.stop()
			return nil, fmt.Errorf("postgres exited: %v\n%s", werr, tail(string(lg), 2000))
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("postgres not accepting connections within 120 s: %v", err)
		}
	}
}

// stop shuts the server down (fast shutdown) and removes its files.
func (s *scratch) stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-s.exited:
		case <-time.After(60 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.exited
		}
	}
	if os.Getenv(countsKeepEnv) == "" {
		_ = os.RemoveAll(s.dir)
	}
}

// netListenLoopback returns a loopback TCP port nobody listened on a moment
// ago.
func netListenLoopback() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
