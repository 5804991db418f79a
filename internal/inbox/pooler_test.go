package inbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The pooler tests run a second service in a child process (this test
// binary, TestPoolerChildService), so that two processes share the
// pooler's server connections: names a process numbers for itself collide
// only across processes.
const (
	poolerChildEnv = "IDEMPOTENCY_POOLER_CHILD" // "url|schema|service|exec mode|events seed"
	poolerEvents   = 30                         // events per service, each delivered 3 times
)

var poolerExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// poolerService is one service behind the pooler: its own claim table,
// consumer and effect table (schema-qualified: PgBouncer forwards no
// search_path).
type poolerService struct {
	schema, name string
	store        *processedstore.Store
	// ownStatements: the handler also runs a statement of its own in the
	// pool's exec mode (pgx's statement cache in its default mode).
	ownStatements bool
}

func newPoolerService(t testing.TB, schema, name string) poolerService {
	t.Helper()
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_" + name, Horizon: time.Hour})
	require.NoError(t, err)
	return poolerService{schema: schema, name: name, store: store}
}

func (s poolerService) migrate(t testing.TB, admin *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, s.store.Migrate(ctx, sqldb.Pgx(admin)))
	_, err := admin.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s.effect_%s (id bigserial PRIMARY KEY, event_id uuid NOT NULL)`, s.schema, s.name))
	require.NoError(t, err)
}

// poolerEventIDs are the service's events, from seed (the same in both
// processes).
func poolerEventIDs(seed uint64) []uuid.UUID {
	r := rand.New(rand.NewPCG(seed, seed))
	ids := make([]uuid.UUID, poolerEvents)
	for i := range ids {
		id := uuid.Must(uuid.NewV7())
		// Keep the v7 time (the replay window) and randomise the rest from
		// seed, so both processes derive the same ids.
		for j := 8; j < 16; j++ {
			id[j] = byte(r.Uint32())
		}
		id[8] = id[8]&0x3f | 0x80
		ids[i] = id
	}
	return ids
}

// run delivers every event of ids three times (shuffled, 3 workers) to
// the service's middleware over pool, retrying each delivery in place while
// its error is held (transient or configuration), and returns the number of
// deliveries that would have been poisoned (an ordinary or permanent
// error) and the number of held failures seen.
func (s poolerService) run(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID) (poisoned, held int64, firstPoison error) {
	t.Helper()
	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: s.store, Consumer: "svc_" + s.name}, watermill.NopLogger{})
	require.NoError(t, err)
	insert := fmt.Sprintf(`INSERT INTO %s.effect_%s (event_id) VALUES ($1)`, s.schema, s.name)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		if s.ownStatements {
			var got uuid.UUID
			if err := tx.QueryRow(msg.Context(), `SELECT $1::uuid`, msg.UUID).Scan(&got); err != nil {
				return nil, err
			}
		}
		// The effect in the simple protocol: the subject is the claim's
		// statements, not the handler's own (pgx's cache).
		_, err := tx.Exec(msg.Context(), insert, pgx.QueryExecModeSimpleProtocol, msg.UUID)
		return nil, err
	})
	var deliveries []uuid.UUID
	for i := 0; i < 3; i++ {
		deliveries = append(deliveries, ids...)
	}
	rand.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	var (
		next     atomic.Int64
		wg       sync.WaitGroup
		mu       sync.Mutex
		pois, hd atomic.Int64
	)
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(deliveries) {
					return
				}
				for try := 0; ; try++ {
					_, err := h(preparedClaimMsg(t, deliveries[i], `{"n":1}`))
					if err == nil {
						break
					}
					c := inbox.ClassOf(err)
					if c == inbox.ClassOrdinary || c == inbox.ClassPermanent || try == 200 {
						pois.Add(1)
						mu.Lock()
						if firstPoison == nil {
							firstPoison = err
						}
						mu.Unlock()
						break
					}
					hd.Add(1)
					time.Sleep(time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	return pois.Load(), hd.Load(), firstPoison
}

// TestPoolerChildService is the second process of the pooler tests; it
// does nothing unless started by one of them.
func TestPoolerChildService(t *testing.T) {
	spec := os.Getenv(poolerChildEnv)
	if spec == "" {
		t.Skip("the child process of the pooler tests")
	}
	f := strings.Split(spec, "|")
	require.Len(t, f, 5)
	mode, err := strconv.Atoi(f[3])
	require.NoError(t, err)
	seed, err := strconv.ParseUint(f[4], 10, 64)
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig(f[0])
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecMode(mode)
	cfg.MaxConns = 3
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	s := newPoolerService(t, f[1], f[2])
	poisoned, held, first := s.run(t, pool, poolerEventIDs(seed))
	fmt.Printf("POOLER-CHILD poisoned=%d held=%d first=%v\n", poisoned, held, first)
}

// Behind PgBouncer (Debian's 1.18, and 1.24 with and without
// max_prepared_statements) in transaction and in session pooling, in every
// pgx exec mode, two services in two processes sharing the pooler's server
// connections (default_pool_size = 2) each apply every event once, though
// each is delivered three times: no claim of one service runs under a name
// the other prepared (its row would land in the other's table and its
// redelivery apply the effect again), and no pooler error (26000, 42P05)
// is poisoned (case 27.1).
func TestPoolerTwoServicesApplyEachEventOnce(t *testing.T) {
	t.Parallel()
	for _, setup := range []struct {
		name, poolMode string
		newer          bool     // testenv.StartNewerPgBouncer (1.24) instead of Debian's 1.18
		settings       []string // more [pgbouncer] lines
	}{
		{"transaction", "transaction", false, nil},
		{"session", "session", false, nil},
		// 1.21+ prepares protocol-level named statements on each server
		// connection itself (max_prepared_statements, default 200 since
		// 1.22), or passes them through as 1.18 does (0).
		{"1.24-prepared/transaction", "transaction", true, []string{"max_prepared_statements = 200"}},
		{"1.24-unprepared/transaction", "transaction", true, []string{"max_prepared_statements = 0"}},
	} {
		for _, mode := range poolerExecModes {
			t.Run(setup.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				size := "2"
				if setup.poolMode == "session" {
					size = "8" // a session holds its server connection: room for both pools
				}
				start := testenv.StartPgBouncer
				if setup.newer {
					start = testenv.StartNewerPgBouncer
				}
				bouncer := start(t, setup.poolMode, append([]string{"default_pool_size = " + size}, setup.settings...)...)
				admin, schema := testenv.Pool(t)
				a, b := newPoolerService(t, schema, "a"), newPoolerService(t, schema, "b")
				a.migrate(t, admin)
				b.migrate(t, admin)
				seedA, seedB := rand.Uint64(), rand.Uint64()

				// Both services are child processes of their own (a
				// process-wide statement counter starts alike in each).
				children := map[string]*strings.Builder{}
				var cmds []*exec.Cmd
				for _, svc := range []struct {
					name string
					seed uint64
				}{{"a", seedA}, {"b", seedB}} {
					child := exec.Command(os.Args[0], "-test.run", "^TestPoolerChildService$", "-test.count=1", "-test.v")
					child.Env = append(os.Environ(), poolerChildEnv+"="+strings.Join([]string{
						bouncer.URL, schema, svc.name, strconv.Itoa(int(mode)), strconv.FormatUint(svc.seed, 10)}, "|"))
					out := &strings.Builder{}
					child.Stdout, child.Stderr = out, out
					require.NoError(t, child.Start())
					children[svc.name] = out
					cmds = append(cmds, child)
				}
				var waits []error
				for _, c := range cmds {
					waits = append(waits, c.Wait())
				}
				for _, err := range waits {
					require.NoError(t, err, children["a"].String()+children["b"].String())
				}
				for _, name := range []string{"a", "b"} {
					out := children[name].String()
					t.Logf("service %s: %s", name, lastLine(out, "POOLER-CHILD"))
					require.Contains(t, out, "POOLER-CHILD poisoned=0 ", "service %s: no delivery poisoned", name)
				}

				for _, svc := range []poolerService{a, b} {
					var rows, foreign, effects, twice int
					require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(*) FILTER (WHERE consumer <> 'svc_%s') FROM %s.processed_%s`,
						svc.name, schema, svc.name)).Scan(&rows, &foreign))
					require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(*) FILTER (WHERE n > 1) FROM (
SELECT event_id, count(*) AS n FROM %s.effect_%s GROUP BY event_id) e`, schema, svc.name)).Scan(&effects, &twice))
					require.Zero(t, foreign, "claims of the other service in %s's table", svc.name)
					require.Zero(t, twice, "events of service %s applied more than once", svc.name)
					require.Equal(t, poolerEvents, effects, "events of service %s applied", svc.name)
					require.Equal(t, poolerEvents, rows, "claims of service %s", svc.name)
				}
			})
		}
	}
}

// lastLine is the last line of s that starts with prefix.
func lastLine(s, prefix string) string {
	found := ""
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			found = l
		}
	}
	return found
}

// With pgx's defaults (QueryExecModeCacheStatement) behind PgBouncer in
// transaction pooling, the handler's own statements, cached by pgx under
// names of their SQL, meet the pooler's shared server connections: 26000
// (a statement prepared on another server connection) and 42P05 (a name
// another client prepared on this one). Those errors are held and retried
// in place, never poisoned, and every event is applied once (case 27.1;
// measured before: 486 of 500 deliveries dead-lettered).
func TestPoolerErrorsOfHandlerStatementsAreHeld(t *testing.T) {
	t.Parallel()
	held := runHandlerStatementsBehind(t, testenv.StartPgBouncer(t, "transaction", "default_pool_size = 1"))
	t.Logf("held: %v", held)
}

// Behind PgBouncer 1.24 with max_prepared_statements (the setting README
// recommends for pgx's default cache mode behind a transaction pooler) the
// pooler prepares each client's named statements on whichever server
// connection runs them: the handler's cached statements never meet 26000 or
// 42P05, so no delivery is even held, and every event is applied once.
func TestPoolerWithPreparedStatementsHoldsNothing(t *testing.T) {
	t.Parallel()
	held := runHandlerStatementsBehind(t, testenv.StartNewerPgBouncer(t, "transaction", "default_pool_size = 1", "max_prepared_statements = 200"))
	require.Equal(t, [2]int64{}, held, "deliveries held")
}

// runHandlerStatementsBehind runs two services whose handlers run their own
// statements in pgx's default cache mode behind bouncer, checks that none
// of their deliveries is poisoned and that each applies every event once,
// and returns how many deliveries each held.
func runHandlerStatementsBehind(t *testing.T, bouncer *testenv.PgBouncer) (held [2]int64) {
	t.Helper()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	var wg sync.WaitGroup
	var poisoned [2]int64
	var first [2]error
	for i, name := range []string{"a", "b"} {
		svc := newPoolerService(t, schema, name)
		svc.ownStatements = true
		svc.migrate(t, admin)
		pool := bouncer.PoolBehind(t, pgx.QueryExecModeCacheStatement, 2)
		wg.Add(1)
		go func() {
			defer wg.Done()
			poisoned[i], held[i], first[i] = svc.run(t, pool, poolerEventIDs(rand.Uint64()))
		}()
	}
	wg.Wait()
	for i, name := range []string{"a", "b"} {
		require.Zero(t, poisoned[i], "service %s: %v", name, first[i])
		var effects, twice int
		require.NoError(t, admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(*) FILTER (WHERE n > 1) FROM (
SELECT event_id, count(*) AS n FROM %s.effect_%s GROUP BY event_id) e`, schema, name)).Scan(&effects, &twice))
		require.Zero(t, twice)
		require.Equal(t, poolerEvents, effects)
	}
	return held
}

// TestCommitGuardBehindPoolers (issue 27 item 4): behind PgBouncer 1.18
// and 1.24, in session and in transaction pooling, with pgx's default exec
// mode, a handler that ends the attempt's transaction by SQL and goes on
// writing in a new one is poisoned once and nothing it wrote after its own
// BEGIN is committed; a handler that behaves commits at once, and a
// redelivery applies its effect once.
// fourPoolers are the PgBouncer setups the claim is tested behind: Debian's
// 1.18 and 1.24 (IDEMPOTENCY_PGBOUNCER_NEWER), each in transaction pooling
// with one server connection and in session pooling.
var fourPoolers = []struct {
	name  string
	start func(t *testing.T) *testenv.PgBouncer
}{
	{"1.18-transaction", func(t *testing.T) *testenv.PgBouncer {
		return testenv.StartPgBouncer(t, "transaction", "default_pool_size = 1")
	}},
	{"1.18-session", func(t *testing.T) *testenv.PgBouncer { return testenv.StartPgBouncer(t, "session") }},
	{"1.24-transaction-prepared", func(t *testing.T) *testenv.PgBouncer {
		return testenv.StartNewerPgBouncer(t, "transaction", "default_pool_size = 1", "max_prepared_statements = 200")
	}},
	{"1.24-session", func(t *testing.T) *testenv.PgBouncer { return testenv.StartNewerPgBouncer(t, "session") }},
}

func TestCommitGuardBehindPoolers(t *testing.T) {
	t.Parallel()
	for _, p := range fourPoolers {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin, schema := testenv.Pool(t)
			pool := p.start(t).PoolBehind(t, pgx.QueryExecModeCacheStatement, 1)
			store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			effect := schema + ".effect"
			_, err = admin.Exec(ctx, `CREATE TABLE `+effect+` (event_id uuid NOT NULL, part text NOT NULL)`)
			require.NoError(t, err)
			b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			count := func(id, part string) (n int) {
				require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+effect+` WHERE event_id = $1 AND part = $2`, id, part).Scan(&n))
				return n
			}
			write := func(msg *message.Message, part string) error {
				tx, _ := inbox.PgxTxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), `INSERT INTO `+effect+` (event_id, part) VALUES ($1, $2)`, msg.UUID, part)
				return err
			}
			poison := &capture{msgs: make(chan *message.Message, 4)}
			good := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				return nil, write(msg, "before")
			})
			for _, end := range [][]string{{"ROLLBACK", "BEGIN"}, {"COMMIT", "BEGIN"}, {"COMMIT AND CHAIN"}, {"ROLLBACK"}} {
				t.Run(strings.ReplaceAll(strings.Join(end, "+"), " ", "_"), func(t *testing.T) {
					calls := 0
					misuse := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
						calls++
						if err := write(msg, "before"); err != nil {
							return nil, err
						}
						tx, _ := inbox.PgxTxFromContext(msg.Context())
						for _, s := range end {
							if _, err := tx.Exec(msg.Context(), s); err != nil {
								return nil, err
							}
						}
						if len(end) == 2 || strings.HasSuffix(end[0], "CHAIN") {
							return nil, write(msg, "after")
						}
						return nil, nil
					})
					id := uuid.Must(uuid.NewV7()).String()
					_, err := misuse(newMsg(id))
					require.NoError(t, err, "acked once poisoned")
					require.Equal(t, 1, calls, "poisoned at once, never retried")
					require.Len(t, poison.msgs, 1, "poisoned once")
					<-poison.msgs
					require.Zero(t, count(id, "after"), "what the handler wrote after its own BEGIN is not committed")
					for range 2 {
						_, err = good(newMsg(id))
						require.NoError(t, err)
					}
					require.Equal(t, 1, count(id, "before"), "the effect is applied once")
					require.Empty(t, poison.msgs)
				})
			}
		})
	}
}

// Behind a pooler the lock timeout stays in the attempt's transaction (SET
// LOCAL in the claim's batch): the claim's wait is still bounded, and no
// server session the pooler shares keeps the consumer's lock_timeout
// after an attempt. Direct connections make it the session's setting
// (TestLockTimeoutHoldsForTheHandler); a pooler gives its clients a
// process ID of its own, which is how the claim tells them apart.
func TestLockTimeoutBehindPoolersStaysInTheTransaction(t *testing.T) {
	t.Parallel()
	for _, p := range fourPoolers {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			admin, schema := testenv.Pool(t)
			bouncer := p.start(t)
			pool := bouncer.PoolBehind(t, pgx.QueryExecModeCacheStatement, 1)
			table := pgx.Identifier{schema, "processed_event"}.Sanitize()
			store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock", LockTimeout: 60 * time.Millisecond}, watermill.NopLogger{})
			require.NoError(t, err)
			var seen string
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := inbox.PgxTxFromContext(msg.Context())
				return nil, tx.QueryRow(msg.Context(), "SHOW lock_timeout").Scan(&seen)
			})
			_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
			require.Equal(t, "60ms", seen, "the handler runs under the lock timeout")

			// What the pooler's server session keeps after the attempt, as
			// the pool's own connection sees it (in transaction pooling
			// with one server connection, also any other client's).
			c, err := pool.Acquire(ctx)
			require.NoError(t, err)
			var after string
			require.NoError(t, c.QueryRow(ctx, "SHOW lock_timeout").Scan(&after))
			c.Release()
			require.Equal(t, "0", after, "no session setting left behind a pooler")

			// The claim's wait is bounded: the claim table is held by
			// another session.
			claimOnHeldTableIsInFlight(t, h, table, hrevFailsafe)
		})
	}
}
