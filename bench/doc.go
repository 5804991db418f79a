// Package bench measures what the effectively-once guarantee costs: the claim
// next to a handler's own transaction, against the alternatives (Watermill's
// in-memory Deduplicator, SELECT-then-INSERT, a claim in its own transaction),
// its growth with the processed table, the end-to-end cost over RabbitMQ, the
// purge under load, memory and allocations.
//
// Run it with `make bench-quick` (small sizes, under a minute) or `make bench`
// (the full sizes; about 25 minutes, writes bench/RESULTS.md). Both print a
// table and, as the last line of standard output, one JSON object: the keys
// of RequiredKeys first, then the others. Progress goes to standard error.
// Services: DATABASE_URL and AMQP_URL, or the defaults of internal/testenv.
// Each part works in a PostgreSQL schema and on RabbitMQ queues of its own
// (random names), removed at the end, so it can share the servers with tests.
// synchronous_commit is left on: with it off an acked message can be lost.
//
// # How ratios are measured
//
// The machines are shared and noisy, so every headline figure is a ratio of
// two variants measured in the same process, interleaved: each round runs
// every variant once (the order rotates from round to round) and a ratio is
// the median of its per-round ratios. Absolute rates and latencies are
// printed beside the ratios as context only. Where PostgreSQL runs on the
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
// rate of new messages); claim_p50_ratio and claim_p99_ratio compare the
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
// prefetch 50 (the fastest setup, where a per-message cost weighs most).
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
// (ours − none on the server), duplicate_cpu_ratio (client + server
// instructions of a duplicate ÷ those of a new message), wal_bytes_per_msg,
// allocs_per_msg_chain and _plain. Without valgrind (or in the tiny profile)
// they are null. See counts.go.
//
// "experiments" (only with -parts experiments) compares configurations of
// the claim that could lower its cost: no per-transaction lock_timeout,
// no processed_at index, a BRIN processed_at index.
//
// The Go benchmarks (go test -run '^$' -bench . -benchmem ./bench) run one
// variant at a time, for profiling and allocations; TestQuickCodePathTiny
// runs every part on tiny sizes and checks the JSON line, in CI.
package bench
