package versioned_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"modernc.org/sqlite"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// harness is one target (dialect and driver, testenv.TargetNames) on a
// fresh database of its own: DB runs statements outside any transaction,
// Begin opens a transaction.
type harness struct {
	testenv.Target
}

// driver opens a harness with at most maxConns connections.
type driver struct {
	name string
	open func(t *testing.T, maxConns int32) *harness
}

// drivers are the contract suite's targets: PostgreSQL through pgx and
// database/sql, MariaDB (the MySQL dialect), SQLite.
var drivers = func() []driver {
	var ds []driver
	for _, name := range testenv.TargetNames {
		ds = append(ds, driver{name: name, open: func(t *testing.T, maxConns int32) *harness {
			return &harness{testenv.NewTarget(t, name, int(maxConns))}
		}})
	}
	return ds
}()

// keyType is a column type usable in a primary key (MySQL cannot index text
// without a prefix length), compared byte by byte as on PostgreSQL and
// SQLite: VARBINARY, as the package doc asks (MySQL's default collations
// fold case and ignore trailing spaces).
func (h *harness) keyType() string {
	if h.Dialect == sqldb.MySQL {
		return "varbinary(255)"
	}
	return "text"
}

// customerDDL creates the customer_copy table (or table) for the dialect.
func (h *harness) customerDDL(table string) string {
	return "CREATE TABLE " + table + " (customer_id " + h.keyType() + " PRIMARY KEY, version bigint, name text)"
}

func (h *harness) exec(t *testing.T, query string, args ...any) {
	t.Helper()
	h.Exec(t, query, args...)
}

// apply runs one Apply in its own committed transaction (rolled back on error).
func (h *harness) apply(t *testing.T, u *versioned.Upsert, key []any, version *int64, values []any) (versioned.Outcome, error) {
	t.Helper()
	tx := h.Begin(t)
	out, err := u.Apply(context.Background(), testenv.AsTx(tx), key, version, values)
	if err != nil {
		require.NoError(t, tx.Rollback())
		return out, err
	}
	require.NoError(t, tx.Commit())
	return out, nil
}

// customerRow is a row of customer_copy; found is false when there is none.
type customerRow struct {
	found   bool
	version *int64
	name    *string
}

func (h *harness) customer(t *testing.T, table, id string) customerRow {
	t.Helper()
	var r customerRow
	err := h.DB.QueryRow(context.Background(),
		h.Rebind("SELECT version, name FROM "+table+" WHERE customer_id = $1"), id).Scan(&r.version, &r.name)
	if errors.Is(err, sqldb.ErrNoRows) {
		return r
	}
	require.NoError(t, err)
	r.found = true
	return r
}

func requireCustomer(t *testing.T, h *harness, table, id string, version int64, name string) {
	t.Helper()
	r := h.customer(t, table, id)
	require.True(t, r.found, "no row for %s", id)
	require.NotNil(t, r.version, "version of %s is NULL", id)
	require.NotNil(t, r.name, "name of %s is NULL", id)
	require.Equal(t, version, *r.version, "version of %s", id)
	require.Equal(t, name, *r.name, "name of %s", id)
}

func customerUpsert(t *testing.T, h *harness, table string) *versioned.Upsert {
	t.Helper()
	u, err := versioned.NewUpsert(versioned.UpsertConfig{
		Table:         table,
		KeyColumns:    []string{"customer_id"},
		VersionColumn: "version",
		ValueColumns:  []string{"name"},
		Dialect:       h.Dialect,
	})
	require.NoError(t, err)
	return u
}

func v(n int64) *int64 { return &n }

func requirePermanent(t *testing.T, err error) {
	t.Helper()
	var p interface{ Permanent() bool }
	require.True(t, errors.As(err, &p), "error %v does not report itself permanent", err)
	require.True(t, p.Permanent())
}

// TestUpsertAppliesOutOfOrderVersionsOnce (case C12, at the upsert level):
// events decoded from JSON payloads, applied out of order, each in its own transaction.
func TestUpsertAppliesOutOfOrderVersionsOnce(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			h := d.open(t, 2)
			h.exec(t, h.customerDDL("customer_copy"))
			u := customerUpsert(t, h, "customer_copy")

			type customerChanged struct {
				CustomerID string `json:"customer_id"`
				Version    *int64 `json:"version"`
				Name       string `json:"name"`
			}
			apply := func(payload string) (versioned.Outcome, error) {
				var ev customerChanged
				require.NoError(t, json.Unmarshal([]byte(payload), &ev))
				return h.apply(t, u, []any{ev.CustomerID}, ev.Version, []any{ev.Name})
			}

			// c-1: v3 "Carol", v1 "Alice", v2 "Bea", v3 "Zed".
			var outcomes []versioned.Outcome
			for _, p := range []string{
				`{"customer_id":"c-1","version":3,"name":"Carol"}`,
				`{"customer_id":"c-1","version":1,"name":"Alice"}`,
				`{"customer_id":"c-1","version":2,"name":"Bea"}`,
				`{"customer_id":"c-1","version":3,"name":"Zed"}`,
			} {
				out, err := apply(p)
				require.NoError(t, err, p)
				outcomes = append(outcomes, out)
			}
			require.Equal(t, []versioned.Outcome{versioned.Inserted, versioned.Stale, versioned.Stale, versioned.Stale}, outcomes)
			requireCustomer(t, h, "customer_copy", "c-1", 3, "Carol")

			// c-2: a legacy row with a NULL version is older than v1.
			h.exec(t, "INSERT INTO customer_copy (customer_id, version, name) VALUES ('c-2', NULL, 'Legacy')")
			out, err := apply(`{"customer_id":"c-2","version":1,"name":"New"}`)
			require.NoError(t, err)
			require.Equal(t, versioned.Updated, out)
			requireCustomer(t, h, "customer_copy", "c-2", 1, "New")

			// c-3: version missing, then version null: permanent, nothing written.
			for _, p := range []string{
				`{"customer_id":"c-3","name":"Nobody"}`,
				`{"customer_id":"c-3","version":null,"name":"Nobody"}`,
			} {
				_, err := apply(p)
				require.ErrorIs(t, err, versioned.ErrVersionMissing, p)
				requirePermanent(t, err)
			}
			require.False(t, h.customer(t, "customer_copy", "c-3").found, "a c-3 row was written")
		})
	}
}

// TestUpsertContract runs the same contract against each driver.
func TestUpsertContract(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			exerciseUpsert(t, d)
		})
	}
}

func exerciseUpsert(t *testing.T, d driver) {
	ctx := context.Background()

	// setup opens a harness with customer_copy and its Upsert.
	setup := func(t *testing.T, maxConns int32) (*harness, *versioned.Upsert) {
		h := d.open(t, maxConns)
		h.exec(t, h.customerDDL("customer_copy"))
		return h, customerUpsert(t, h, "customer_copy")
	}

	t.Run("OnlyStrictlyGreaterApplies", func(t *testing.T) {
		t.Parallel()
		h, u := setup(t, 2)
		steps := []struct {
			version     int64
			name        string
			want        versioned.Outcome
			wantVersion int64
			wantName    string
		}{
			{5, "a", versioned.Inserted, 5, "a"},
			{6, "b", versioned.Updated, 6, "b"},
			{6, "c", versioned.Stale, 6, "b"},       // equal: never overwrites
			{2, "d", versioned.Stale, 6, "b"},       // lower
			{100, "e", versioned.Updated, 100, "e"}, // a gap is fine
			{-1, "f", versioned.Stale, 100, "e"},
		}
		for _, s := range steps {
			out, err := h.apply(t, u, []any{"k"}, v(s.version), []any{s.name})
			require.NoError(t, err)
			require.Equal(t, s.want, out, "v%d", s.version)
			require.Equal(t, s.want != versioned.Stale, out.Applied())
			requireCustomer(t, h, "customer_copy", "k", s.wantVersion, s.wantName)
		}
	})

	t.Run("StoredNullIsOlderThanAnyVersion", func(t *testing.T) {
		t.Parallel()
		h, u := setup(t, 2)
		h.exec(t, "INSERT INTO customer_copy VALUES ('zero', NULL, 'legacy'), ('min', NULL, 'legacy')")
		out, err := h.apply(t, u, []any{"zero"}, v(0), []any{"new"})
		require.NoError(t, err)
		require.Equal(t, versioned.Updated, out)
		requireCustomer(t, h, "customer_copy", "zero", 0, "new")
		out, err = h.apply(t, u, []any{"min"}, v(-1<<63), []any{"new"})
		require.NoError(t, err)
		require.Equal(t, versioned.Updated, out)
		requireCustomer(t, h, "customer_copy", "min", -1<<63, "new")
	})

	t.Run("MissingVersionIsPermanentAndWritesNothing", func(t *testing.T) {
		t.Parallel()
		h, u := setup(t, 2)
		_, err := h.apply(t, u, []any{"k"}, v(1), []any{"kept"})
		require.NoError(t, err)
		h.exec(t, "INSERT INTO customer_copy VALUES ('legacy', NULL, 'legacy')")

		for _, key := range []string{"k", "legacy", "new"} {
			out, err := h.apply(t, u, []any{key}, nil, []any{"overwritten"})
			require.ErrorIs(t, err, versioned.ErrVersionMissing)
			require.Zero(t, out)
			requirePermanent(t, err)
			require.Contains(t, err.Error(), "customer_copy")
		}
		requireCustomer(t, h, "customer_copy", "k", 1, "kept")
		r := h.customer(t, "customer_copy", "legacy")
		require.Nil(t, r.version)
		require.Equal(t, "legacy", *r.name)
		require.False(t, h.customer(t, "customer_copy", "new").found)
	})

	t.Run("WrongArgumentsArePermanent", func(t *testing.T) {
		t.Parallel()
		h, u := setup(t, 2)
		var nilString *string
		cases := []struct {
			name   string
			key    []any
			values []any
			want   error
		}{
			{"no key", nil, []any{"x"}, versioned.ErrArgCount},
			{"two keys", []any{"a", "b"}, []any{"x"}, versioned.ErrArgCount},
			{"no values", []any{"a"}, nil, versioned.ErrArgCount},
			{"two values", []any{"a"}, []any{"x", "y"}, versioned.ErrArgCount},
			{"nil key", []any{nil}, []any{"x"}, versioned.ErrKeyMissing},
			{"nil pointer key", []any{nilString}, []any{"x"}, versioned.ErrKeyMissing},
		}
		for _, c := range cases {
			out, err := h.apply(t, u, c.key, v(1), c.values)
			require.ErrorIs(t, err, c.want, c.name)
			require.Zero(t, out)
			requirePermanent(t, err)
		}
		var n int
		require.NoError(t, h.DB.QueryRow(ctx, "SELECT count(*) FROM customer_copy").Scan(&n))
		require.Zero(t, n)

		// A NULL value column is an ordinary value.
		out, err := h.apply(t, u, []any{"a"}, v(1), []any{nil})
		require.NoError(t, err)
		require.Equal(t, versioned.Inserted, out)
		r := h.customer(t, "customer_copy", "a")
		require.Nil(t, r.name)
	})

	t.Run("ValuesAreBoundParameters", func(t *testing.T) {
		t.Parallel()
		h, u := setup(t, 2)
		evil := `x'); DROP TABLE customer_copy; --`
		evilName := `"; DELETE FROM customer_copy; --`
		out, err := h.apply(t, u, []any{evil}, v(1), []any{evilName})
		require.NoError(t, err)
		require.Equal(t, versioned.Inserted, out)
		requireCustomer(t, h, "customer_copy", evil, 1, evilName)
	})

	t.Run("CompositeKeyAndNoValueColumns", func(t *testing.T) {
		t.Parallel()
		h := d.open(t, 2)
		kt := h.keyType()
		h.exec(t, `CREATE TABLE stock_seen (warehouse `+kt+`, sku `+kt+`, `+h.Quote("Version")+` bigint, note `+kt+` DEFAULT 'default', PRIMARY KEY (sku, warehouse))`)
		u, err := versioned.NewUpsert(versioned.UpsertConfig{
			Table:         "stock_seen",
			KeyColumns:    []string{"warehouse", "sku"},
			VersionColumn: "Version", // quoted: case-sensitive on PostgreSQL
			Dialect:       h.Dialect,
		})
		require.NoError(t, err)
		for _, s := range []struct {
			wh, sku string
			version int64
			want    versioned.Outcome
		}{
			{"w1", "s1", 1, versioned.Inserted},
			{"w1", "s2", 1, versioned.Inserted},
			{"w2", "s1", 7, versioned.Inserted},
			{"w1", "s1", 2, versioned.Updated},
			{"w2", "s1", 3, versioned.Stale},
		} {
			out, err := h.apply(t, u, []any{s.wh, s.sku}, v(s.version), nil)
			require.NoError(t, err)
			require.Equal(t, s.want, out, "%s/%s v%d", s.wh, s.sku, s.version)
		}
		var got []string
		tx := h.Begin(t)
		for _, k := range [][2]string{{"w1", "s1"}, {"w1", "s2"}, {"w2", "s1"}} {
			var version int64
			var note string
			require.NoError(t, tx.QueryRow(ctx, h.Rebind(`SELECT `+h.Quote("Version")+`, note FROM stock_seen WHERE warehouse = $1 AND sku = $2`), k[0], k[1]).Scan(&version, &note))
			got = append(got, fmt.Sprintf("%s/%s=%d,%s", k[0], k[1], version, note))
		}
		require.NoError(t, tx.Rollback())
		require.Equal(t, []string{"w1/s1=2,default", "w1/s2=1,default", "w2/s1=7,default"}, got)
	})

	t.Run("SchemaQualifiedTable", func(t *testing.T) {
		t.Parallel()
		h := d.open(t, 2)
		// A schema not on the connection's search path (PostgreSQL), another
		// database (MySQL), the main database named explicitly (SQLite).
		var other string
		switch h.Dialect {
		case sqldb.PostgreSQL:
			other = testenv.Schema(t)
		case sqldb.MySQL:
			other = testenv.MySQLDatabase(t)
		default:
			other = "main"
		}
		table := other + ".customer_copy"
		h.exec(t, h.customerDDL(table))
		u := customerUpsert(t, h, table)
		out, err := h.apply(t, u, []any{"c"}, v(1), []any{"one"})
		require.NoError(t, err)
		require.Equal(t, versioned.Inserted, out)
		out, err = h.apply(t, u, []any{"c"}, v(2), []any{"two"})
		require.NoError(t, err)
		require.Equal(t, versioned.Updated, out)
		requireCustomer(t, h, table, "c", 2, "two")
	})

	t.Run("DatabaseErrorsKeepTheirCode", func(t *testing.T) {
		t.Parallel()
		h := d.open(t, 2)
		h.exec(t, "CREATE TABLE no_key (customer_id "+h.keyType()+", version bigint, name text)")
		u := customerUpsert(t, h, "no_key")
		_, err := h.apply(t, u, []any{"c"}, v(1), []any{"x"})
		switch h.Dialect {
		case sqldb.PostgreSQL:
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "42P10", pgErr.Code) // no unique constraint matching ON CONFLICT
		case sqldb.SQLite:
			var sqliteErr *sqlite.Error
			require.ErrorAs(t, err, &sqliteErr)
			require.Equal(t, 1, sqliteErr.Code()) // SQLITE_ERROR: ON CONFLICT matches no unique index
		case sqldb.MySQL:
			// The documented limit (UpsertConfig.KeyColumns): without a
			// unique index, ON DUPLICATE KEY UPDATE never fires.
			require.NoError(t, err)
			_, err = h.apply(t, u, []any{"c"}, v(2), []any{"y"})
			require.NoError(t, err)
			var n int
			require.NoError(t, h.DB.QueryRow(ctx, "SELECT count(*) FROM no_key").Scan(&n))
			require.Equal(t, 2, n, "every Apply inserts")
			// A database error keeps its number.
			_, err = h.apply(t, customerUpsert(t, h, "missing_table"), []any{"c"}, v(1), []any{"x"})
			var myErr *mysql.MySQLError
			require.ErrorAs(t, err, &myErr)
			require.EqualValues(t, 1146, myErr.Number) // ER_NO_SUCH_TABLE
		}
		var p interface{ Permanent() bool }
		require.False(t, errors.As(err, &p), "a database error is classified by its caller, not by this package")
	})

	// The concurrent cases hold one transaction open at a point where the
	// other must wait for its lock, check that it waits, then finish the first.
	for _, c := range []struct {
		name        string
		seed        *int64 // stored version before, nil for no row
		first       int64
		second      int64
		firstEnds   string // "commit" or "rollback"
		wantFirst   versioned.Outcome
		wantSecond  versioned.Outcome
		wantVersion int64
		wantName    string
	}{
		{"HigherWaitsThenUpdates", v(1), 2, 3, "commit", versioned.Updated, versioned.Updated, 3, "second"},
		{"LowerWaitsThenIsStale", v(1), 3, 2, "commit", versioned.Updated, versioned.Stale, 3, "first"},
		{"EqualWaitsThenIsStale", v(1), 3, 3, "commit", versioned.Updated, versioned.Stale, 3, "first"},
		{"RacingInsertsHigherSecond", nil, 2, 3, "commit", versioned.Inserted, versioned.Updated, 3, "second"},
		{"RacingInsertsLowerSecond", nil, 3, 2, "commit", versioned.Inserted, versioned.Stale, 3, "first"},
		{"RacingInsertFirstRollsBack", nil, 3, 2, "rollback", versioned.Inserted, versioned.Inserted, 2, "second"},
		{"UpdateFirstRollsBack", v(1), 3, 2, "rollback", versioned.Updated, versioned.Updated, 2, "second"},
	} {
		t.Run("Concurrent"+c.name, func(t *testing.T) {
			t.Parallel()
			h, u := setup(t, 3)
			if c.seed != nil {
				h.exec(t, "INSERT INTO customer_copy VALUES ('k', $1, 'seed')", *c.seed)
			}
			first := h.Begin(t)
			out, err := u.Apply(ctx, testenv.AsTx(first), []any{"k"}, v(c.first), []any{"first"})
			require.NoError(t, err)
			require.Equal(t, c.wantFirst, out)

			done := make(chan applyResult, 1)
			var second *testenv.Tx
			if h.Dialect == sqldb.SQLite {
				// SQLite serialises whole write transactions: the second
				// waits at BEGIN IMMEDIATE (busy_timeout) for the first to
				// end, which no other connection can observe. Its BEGIN
				// returning only after the first ended shows the wait.
				var firstEnded atomic.Int64
				trying := make(chan struct{})
				go func() {
					close(trying)
					tx, err := h.BeginTx(ctx)
					if err != nil {
						done <- applyResult{err: err}
						return
					}
					began := time.Now().UnixNano()
					out, err := u.Apply(ctx, testenv.AsTx(tx), []any{"k"}, v(c.second), []any{"second"})
					if err == nil && began < firstEnded.Load() {
						err = fmt.Errorf("the second transaction began before the first ended")
					}
					if err == nil {
						err = tx.Commit()
					} else {
						_ = tx.Rollback()
					}
					done <- applyResult{out, err}
				}()
				<-trying
				firstEnded.Store(time.Now().UnixNano())
				if c.firstEnds == "commit" {
					require.NoError(t, first.Commit())
				} else {
					require.NoError(t, first.Rollback())
				}
			} else {
				second = h.Begin(t)
				id := h.sessionID(t, second)
				go func() {
					out, err := u.Apply(ctx, testenv.AsTx(second), []any{"k"}, v(c.second), []any{"second"})
					done <- applyResult{out, err}
				}()
				waitForLock(t, h, id, done)
				if c.firstEnds == "commit" {
					require.NoError(t, first.Commit())
				} else {
					require.NoError(t, first.Rollback())
				}
			}
			r := <-done
			require.NoError(t, r.err)
			require.Equal(t, c.wantSecond, r.out)
			if second != nil {
				require.NoError(t, second.Commit())
			}
			requireCustomer(t, h, "customer_copy", "k", c.wantVersion, c.wantName)
		})
	}

	t.Run("ConcurrentWritersEndAtHighestVersion", func(t *testing.T) {
		t.Parallel()
		const writers = 6
		h, u := setup(t, writers)
		for round := range 3 {
			key := fmt.Sprintf("k%d", round)
			versions := rand.Perm(writers)
			outcomes := make([]versioned.Outcome, writers)
			start := make(chan struct{})
			var wg sync.WaitGroup
			var retries atomic.Int32
			for i, n := range versions {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for {
						// A transient error (a MySQL deadlock between racing
						// first inserts) is retried, as the middleware's
						// Retry would; anything else fails the test.
						tx, err := h.BeginTx(ctx)
						if err != nil {
							t.Error(err)
							return
						}
						out, err := u.Apply(ctx, testenv.AsTx(tx), []any{key}, v(int64(n+1)), []any{fmt.Sprintf("v%d", n+1)})
						if err == nil {
							err = tx.Commit()
						} else {
							_ = tx.Rollback()
						}
						if err != nil && mysqlTransient(err) {
							retries.Add(1)
							continue
						}
						if err != nil {
							t.Error(err)
							return
						}
						outcomes[i] = out
						return
					}
				}()
			}
			close(start)
			wg.Wait()
			require.False(t, t.Failed())
			count := map[versioned.Outcome]int{}
			for _, o := range outcomes {
				count[o]++
			}
			require.Equal(t, 1, count[versioned.Inserted], "outcomes %v", outcomes)
			require.Equal(t, writers-1, count[versioned.Updated]+count[versioned.Stale], "outcomes %v", outcomes)
			requireCustomer(t, h, "customer_copy", key, writers, fmt.Sprintf("v%d", writers))
			if n := retries.Load(); n > 0 {
				t.Logf("round %d: %d transient errors retried", round, n)
			}
		}
	})
}

// applyResult is what an Apply run in a goroutine returned.
type applyResult struct {
	out versioned.Outcome
	err error
}

// sessionID is the server's id of tx's connection: the backend pid
// (PostgreSQL) or the connection id (MySQL).
func (h *harness) sessionID(t *testing.T, tx sqldb.Querier) int64 {
	t.Helper()
	query := "SELECT pg_backend_pid()"
	if h.Dialect == sqldb.MySQL {
		query = "SELECT CONNECTION_ID()"
	}
	var id int64
	require.NoError(t, tx.QueryRow(context.Background(), query).Scan(&id))
	return id
}

// waitForLock polls until session id waits on a row lock, failing the test
// if done reports first (the statement did not wait) or after a deadline.
func waitForLock(t *testing.T, h *harness, id int64, done <-chan applyResult) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !h.lockWaiting(t, id) {
		select {
		case r := <-done:
			t.Fatalf("second Apply returned without waiting for the first transaction: %v, %v", r.out, r.err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("session %d never waited on a lock", id)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// lockWaiting reports whether session id waits on a row lock now.
// PostgreSQL: pg_stat_activity. MySQL/MariaDB: the live transaction list of
// SHOW ENGINE INNODB STATUS (information_schema.INNODB_TRX is a cache that
// MariaDB refreshes only when nobody read it for 100 ms, which parallel
// pollers never allow).
func (h *harness) lockWaiting(t *testing.T, id int64) bool {
	t.Helper()
	ctx := context.Background()
	if h.Dialect == sqldb.PostgreSQL {
		var n int
		require.NoError(t, h.DB.QueryRow(ctx,
			"SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'", id).Scan(&n))
		return n > 0
	}
	var typ, name, status string
	require.NoError(t, h.DB.QueryRow(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status))
	thread := fmt.Sprintf(" thread id %d,", id) // "MySQL thread id", "MariaDB thread id"
	for _, trx := range strings.Split(status, "---TRANSACTION ") {
		if strings.Contains(trx, thread) && strings.Contains(trx, "LOCK WAIT") {
			return true
		}
	}
	return false
}

func TestUpsertConfigValidate(t *testing.T) {
	t.Parallel()
	valid := func() versioned.UpsertConfig {
		return versioned.UpsertConfig{
			Table:         "customer_copy",
			KeyColumns:    []string{"tenant", "customer_id"},
			VersionColumn: "version",
			ValueColumns:  []string{"name", "status"},
		}
	}
	require.NoError(t, valid().Validate())
	for _, table := range []string{"shop.customer_copy", "_private", "T1"} {
		c := valid()
		c.Table = table
		require.NoError(t, c.Validate(), table)
	}

	cases := []struct {
		name   string
		mutate func(*versioned.UpsertConfig)
		field  string
	}{
		{"empty table", func(c *versioned.UpsertConfig) { c.Table = "" }, "UpsertConfig.Table: required"},
		{"table injection", func(c *versioned.UpsertConfig) { c.Table = "customer_copy; DROP TABLE users" }, "UpsertConfig.Table:"},
		{"table quote", func(c *versioned.UpsertConfig) { c.Table = `customer_copy" (id) VALUES (1); --` }, "UpsertConfig.Table:"},
		{"table comment", func(c *versioned.UpsertConfig) { c.Table = "t--" }, "UpsertConfig.Table:"},
		{"three parts", func(c *versioned.UpsertConfig) { c.Table = "db.shop.customer_copy" }, "UpsertConfig.Table:"},
		{"empty schema", func(c *versioned.UpsertConfig) { c.Table = ".customer_copy" }, "UpsertConfig.Table:"},
		{"too long", func(c *versioned.UpsertConfig) { c.Table = strings.Repeat("a", 64) }, "UpsertConfig.Table:"},
		{"no keys", func(c *versioned.UpsertConfig) { c.KeyColumns = nil }, "UpsertConfig.KeyColumns: at least one"},
		{"key injection", func(c *versioned.UpsertConfig) { c.KeyColumns[1] = "id) DO NOTHING; --" }, "UpsertConfig.KeyColumns[1]:"},
		{"key qualified", func(c *versioned.UpsertConfig) { c.KeyColumns[0] = "t.tenant" }, "UpsertConfig.KeyColumns[0]:"},
		{"key empty", func(c *versioned.UpsertConfig) { c.KeyColumns[0] = "" }, "UpsertConfig.KeyColumns[0]:"},
		{"key twice", func(c *versioned.UpsertConfig) { c.KeyColumns[1] = "tenant" }, "UpsertConfig.KeyColumns[1]: column \"tenant\" is already KeyColumns[0]"},
		{"no version", func(c *versioned.UpsertConfig) { c.VersionColumn = "" }, "UpsertConfig.VersionColumn: required"},
		{"version injection", func(c *versioned.UpsertConfig) { c.VersionColumn = "version OR true" }, "UpsertConfig.VersionColumn:"},
		{"version is key", func(c *versioned.UpsertConfig) { c.VersionColumn = "customer_id" }, "UpsertConfig.VersionColumn: column \"customer_id\" is already KeyColumns[1]"},
		{"value injection", func(c *versioned.UpsertConfig) { c.ValueColumns[1] = `status" = 'x'` }, "UpsertConfig.ValueColumns[1]:"},
		{"value is version", func(c *versioned.UpsertConfig) { c.ValueColumns[0] = "version" }, "UpsertConfig.ValueColumns[0]: column \"version\" is already VersionColumn"},
		{"unknown dialect", func(c *versioned.UpsertConfig) { c.Dialect = sqldb.Dialect(42) }, "UpsertConfig.Dialect:"},
	}
	for _, c := range cases {
		cfg := valid()
		c.mutate(&cfg)
		err := cfg.Validate()
		require.Error(t, err, c.name)
		require.Contains(t, err.Error(), "versioned: "+c.field, c.name)

		u, err := versioned.NewUpsert(cfg)
		require.Nil(t, u, c.name)
		require.ErrorContains(t, err, "versioned: "+c.field, c.name)
	}

	// Every problem is reported, each with its field.
	err := versioned.UpsertConfig{KeyColumns: []string{"ok", "bad-name"}}.Validate()
	require.ErrorContains(t, err, "UpsertConfig.Table: required")
	require.ErrorContains(t, err, "UpsertConfig.KeyColumns[1]:")
	require.ErrorContains(t, err, "UpsertConfig.VersionColumn: required")
}

// TestUpsertIgnoresLaterConfigChanges: NewUpsert keeps its own copy.
func TestUpsertIgnoresLaterConfigChanges(t *testing.T) {
	t.Parallel()
	h := drivers[0].open(t, 1)
	h.exec(t, h.customerDDL("customer_copy"))
	cfg := versioned.UpsertConfig{
		Table:         "customer_copy",
		KeyColumns:    []string{"customer_id"},
		VersionColumn: "version",
		ValueColumns:  []string{"name"},
	}
	u, err := versioned.NewUpsert(cfg)
	require.NoError(t, err)
	cfg.KeyColumns[0] = "x; DROP TABLE customer_copy"
	cfg.ValueColumns[0] = "version"
	out, err := h.apply(t, u, []any{"c"}, v(1), []any{"n"})
	require.NoError(t, err)
	require.Equal(t, versioned.Inserted, out)
	requireCustomer(t, h, "customer_copy", "c", 1, "n")
}

func TestOutcomeString(t *testing.T) {
	t.Parallel()
	require.Equal(t, "inserted", versioned.Inserted.String())
	require.Equal(t, "updated", versioned.Updated.String())
	require.Equal(t, "stale", versioned.Stale.String())
	require.Equal(t, "Outcome(0)", versioned.Outcome(0).String())
	require.True(t, versioned.Inserted.Applied())
	require.True(t, versioned.Updated.Applied())
	require.False(t, versioned.Stale.Applied())
	require.False(t, versioned.Outcome(0).Applied())
}
