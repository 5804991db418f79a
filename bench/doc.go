// Package bench measures what the effectively-once guarantee costs: the claim
// next to a handler's own transaction, against the alternatives (Watermill's
// in-memory Deduplicator, SELECT-then-INSERT, a claim in its own transaction),
// its growth with the processed table, the end-to-end cost over RabbitMQ and
// over NATS JetStream, the purge under load, memory and allocations.
//
// Run it with `make bench-quick` (small sizes: about a minute, plus a few
// minutes for the counts part under valgrind) or `make bench` (the full
// sizes, writes bench/RESULTS.md; `-parts overhead,e2e,memory,counts`, the
// parts of issue 25's targets, is sized for about 25 minutes on an idle
// 2-core machine; growth and purge add their 1M/10M-row tables). Both print
// a table and, as the last line of standard output, one JSON object: the
// keys of RequiredKeys first, then the others. Progress goes to standard
// error. Both make targets only check that PostgreSQL, RabbitMQ and NATS are
// reachable; they never start or restart a service.
// Services: DATABASE_URL, AMQP_URL and NATS_URL, or the defaults of
// internal/testenv. Each part works in a PostgreSQL schema, on RabbitMQ
// queues and JetStream streams of its own (random names), each removed after
// its run and again at the end, so it can share the servers with tests.
// synchronous_commit is left on: with it off an acked message can be lost.
//
// # How ratios are measured
//
// The machines are shared and noisy, so every headline figure is a ratio of
// two variants measured in the same process, interleaved: each round runs
// every variant once (the order rotates from round to round) and a ratio is
// the median of its per-round ratios. Beside each median the tables print
// the spread of the per-round ratios (min–max), and the JSON carries
// <key>_min, <key>_max and <key>_iqr (Q3 − Q1) for the headline ratios
// (claim_overhead_ratio, _3stmt, inmemory_overhead_ratio, e2e_ratio,
// e2e_ratio_jetstream, the dup30 ratios): a ratio whose rounds straddle its
// target is noise. Absolute rates and latencies are printed beside the
// ratios as context only. Where PostgreSQL runs on the
// same machine, part 1 also reports the CPU time per message (this process
// plus the pool's backends, from /proc/<pid>/schedstat), which other load
// disturbs much less than a rate.
//
// # The parts and their keys
//
// 1. overhead (no broker). The same handler — one INSERT into reservation,
// or three statements (INSERT, UPDATE stock, INSERT log) — run through the
// recommended chain (Poison → Retry → Recoverer → inner) by N concurrent
// workers (1, 4, 16 in the full run; 4 in the quick one). Inner variants:
// none (pgx pool.Begin, handler, Commit), idempotent (our middleware: BEGIN,
// lock_timeout and the claim in one pgx.Batch), unpipelined (ours with
// DisablePipeline), naive (SELECT then INSERT in the handler's transaction),
// separate_tx (the claim committed on its own first), inmemory (Watermill's
// Deduplicator keyed by event id, then the handler's transaction) and
// duplicate (ours fed already-processed ids). At 4 workers:
// claim_overhead_ratio = idempotent ÷ none (one INSERT),
// claim_overhead_ratio_3stmt (three statements), vs_naive_ratio =
// idempotent ÷ naive, vs_separate_tx_ratio, vs_inmemory_ratio,
// duplicate_speedup = duplicate ÷ idempotent (rate of duplicates over the
// rate of new messages); inmemory_overhead_ratio = inmemory ÷ none (the
// Deduplicator's cost, issue 17's measured floor beside the claim; _3stmt
// where the three-statement handler runs it too); claim_p50_ratio and
// claim_p99_ratio compare the
// whole-message latency; claim_cpu_cost_ratio the CPU per message.
//
// 2. growth. Processed tables of every size (0, 1M, 10M rows in the full
// run; the quick run's largest is 100k), filled with UUIDv7 ids in time
// order and, for contrast, UUIDv4 ids, exist at once; every round claims on
// each (2 workers, one-INSERT handler) and reads the claim latency that the
// middleware's Recorder reports (acquire + BEGIN + claim, one round trip).
// growth_p99_ratio_v7 = p99 at the largest size ÷ p99 empty. The WAL of a
// claim is read with EXPLAIN (ANALYZE, WAL) of the claim statement (so other
// sessions' WAL does not count), for claims right after a CHECKPOINT and for
// the ones after those; table and index sizes per million rows.
//
// 3. e2e. A queue pre-filled with persistent messages (our marshaler) is
// drained by a Watermill router (AMQP subscriber, one handler per consumer
// goroutine, prefetch 1/10/50) through the chain and the handler's
// transaction, then acked; with and without our middleware, and with 30 %
// already-processed messages. e2e_ratio = idempotent ÷ none at 4 consumers,
// prefetch 50 (the fastest setup, where a per-message cost weighs most);
// e2e_floor_mechanism_ratio, the bare claim row (floor_mechanism) in the
// same cell, is its floor. The headline cells run in every round, the
// grid's in the first GridRounds.
// 3b, the same over NATS JetStream: a stream per run (file storage, filled
// with acked JetStream publishes through marshaler/jetstream), a durable
// push consumer with a deliver group (MaxAckPending = consumers × prefetch,
// AckWait long enough that nothing is redelivered in a run), watermill-nats
// v2's subscriber in JetStream mode with asynchronous acks, one subscription
// per router handler; the same handler, cells and interleaving (headline cell
// only). e2e_ratio_jetstream, e2e_dup30_ratio_jetstream. Each stream is
// deleted after its run.
//
// 4. purge. Each round inserts expired rows (processed_at two hours ago),
// then runs the claim load without and with processed.Purger.PurgeNow
// deleting them (order alternating). purge_p99_ratio = claim p99 while
// purging ÷ without (median over rounds); purge_worst_ms = the worst claim
// seen while purging (max over rounds); purge_rows_per_s.
//
// 5. memory. One consumer with our middleware drains 100k messages (quick:
// 4k); RSS after 10k and 100k (quick: 1k, 4k) shows whether anything is
// kept per message. allocs_per_msg = allocations per message of
// Idempotent.Middleware around a no-op handler (sequential new events;
// MemStats.Mallocs), with the plain pgx transaction beside it.
//
// allocs_per_msg_plain is the plain transaction's figure (the same as
// allocs_per_msg_plain_tx).
//
// 6. counts. Per message on the one-INSERT handler through the chain (none,
// idempotent, duplicate), one worker: client instructions (the command
// re-runs itself under valgrind's cachegrind), server instructions (a
// scratch PostgreSQL this part starts itself under cachegrind, initdb on a
// free loopback port; never the shared server), WAL bytes and allocations.
// Instruction counts do not move with the machine's load. Each count is
// the difference of a run of N2 and one of N1 messages, divided by N2 − N1.
// Keys: client_instructions_per_msg (ours) and _plain (none),
// server_instructions_per_msg and _plain, server_instructions_per_claim
// (ours − none on the server), client_instructions_per_claim and
// wal_bytes_per_claim (ours − none), duplicate_cpu_ratio (client + server
// instructions of a duplicate in a run of duplicates ÷ those of a new
// message), duplicate_cpu_ratio_isolated (a duplicate outside a run: the
// claim's path) and duplicate_cpu_ratio_redelivered (a duplicate marked as
// a redelivery, crash bound on), wal_bytes_per_msg,
// allocs_per_msg_chain and _plain. server_instructions_per_claim_floor_mechanism,
// _floor_checked, _floor_lean and _floor_today price claim statements alone
// on the same server (bench/floors.go): the uuid-only mechanism, a table
// per consumer (uuid, fingerprint) with every check, issue 25's lean row
// with every check (the shape of <table>_v7, where the middleware claims
// UUIDv7 events), and the table's statement (the previous release's, and
// still for ids of other versions; the lock bound in the statement, as the
// middleware sends it on a raw connection); _floor_checked_session, _floor_lean_session
// and _floor_today_session price the same three with the lock bound per
// session only. Without valgrind (or in the tiny profile) they are null.
// See counts.go.
//
// # Profiling the counts
//
// Three environment variables turn the counts part into a profiler; the
// figures stay the same counts:
//
//	IDEMBENCH_COUNTS_TOOL=callgrind IDEMBENCH_COUNTS_KEEP=1 \
//	IDEMBENCH_COUNTS_VARIANTS=idempotent \
//	go run ./cmd/idembench -quick -parts counts -results /tmp/r.md
//
// IDEMBENCH_COUNTS_TOOL=callgrind runs the scratch server under callgrind,
// so callgrind_annotate --inclusive=yes gives what each server function
// costs with its callees. IDEMBENCH_COUNTS_KEEP keeps the scratch
// directory and logs its path. Each child leaves child_<variant>_<n>.cg
// (client) and child_<variant>_<n>.json, whose pid names its backend's file
// cg/cg.<pid>. A function's cost per message is the difference between the
// N2 and N1 files, divided by N2 − N1. IDEMBENCH_COUNTS_VARIANTS counts only
// the variants it lists, plus none.
//
// # Targets
//
// After the tables the command prints issue 7's targets and issue 25's, each
// with its value, spread over the rounds, bound and whether it is met; issue
// 25's also with the floor beside it (the mechanism alone for the server
// count; for the claim ratios and the end-to-end ones, the mechanism alone
// (floor_mechanism), and the in-memory Deduplicator for the claim ratios,
// measured in the same rounds). WriteMarkdown puts issue 25's as a markdown table at the top of
// RESULTS.md (Result.TargetsMarkdown), for the README's performance section.
//
// "experiments" (only with -parts experiments) compares configurations of
// the claim that could lower its cost: no per-transaction lock_timeout,
// no processed_at index, a BRIN processed_at index.
//
// The Go benchmarks (go test -run '^$' -bench . -benchmem ./bench) run one
// variant at a time, for profiling and allocations; TestQuickCodePathTiny
// runs every part on tiny sizes and checks the JSON line, in CI.
package bench
