package processedstore_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// v7Ms is a random UUIDv7 whose 48-bit millisecond prefix is ms.
func v7Ms(ms int64) uuid.UUID { return v7At(time.UnixMilli(ms)) }

// v4Low is a random UUIDv4 that sorts below every UUIDv7 of this century
// (its first two bytes are zero).
func v4Low() uuid.UUID {
	id := uuid.New()
	id[0], id[1] = 0, 0
	return id
}

type purgeRow struct {
	name     string
	consumer string
	id       uuid.UUID
	at       time.Time
	gone     bool // expired by event_at: the purge must delete it
	noAt     bool // written without event_at (the lean claim's UUIDv7 rows)
}

// The plain layout's purge deletes exactly the rows whose
// event_at is before the cutoff, of every id version, across consumers,
// and the UUIDv7 rows without event_at (the lean claim's) whose id's
// millisecond is before the cutoff's, by a primary-key range per consumer:
// never an unexpired one (UUIDv7 ids of the cutoff's millisecond, a v4 id
// that sorts below the bound, a UUIDv7 dated after its id's time), and it
// skips rows locked by another transaction. The purge runs in a transaction
// whose now() was read first, so the cutoff is known to the microsecond.
func TestPlainPurgeExactlyExpiredV7AndOtherIds(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool))

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var now time.Time
	require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&now))
	cutoff := now.Add(-time.Hour)
	m := cutoff.UnixMilli() // the cutoff's millisecond (floor: after 1970)
	idTime := func(ms int64) time.Time { return time.UnixMilli(ms) }

	var rows []purgeRow
	for _, c := range []string{"billing", "orders", "stock"} {
		rows = append(rows,
			purgeRow{"v7 expired long ago", c, v7Ms(m - 3_600_000), idTime(m - 3_600_000), true, false},
			purgeRow{"v7 expired 1 ms before", c, v7Ms(m - 1), idTime(m - 1), true, false},
			purgeRow{"v7 cutoff's ms, dated at the cutoff", c, v7Ms(m), cutoff, false, false},
			purgeRow{"v7 cutoff's ms, 1 µs before the cutoff", c, v7Ms(m), cutoff.Add(-time.Microsecond), true, false},
			purgeRow{"v7 cutoff's ms, dated by its id", c, v7Ms(m), idTime(m), idTime(m).Before(cutoff), false},
			purgeRow{"v7 1 ms after", c, v7Ms(m + 1), idTime(m + 1), false, false},
			purgeRow{"v7 fresh", c, v7Ms(now.UnixMilli()), idTime(now.UnixMilli()), false, false},
			purgeRow{"v7 old id, dated now (e.g. migration 2's default)", c, v7Ms(m - 7_200_000), now, false, false},
			purgeRow{"v7 fresh id, dated before the cutoff (by hand)", c, v7Ms(now.UnixMilli()), cutoff.Add(-time.Minute), true, false},
			purgeRow{"v4 expired", c, uuid.New(), cutoff.Add(-time.Minute), true, false},
			purgeRow{"v4 1 µs before", c, uuid.New(), cutoff.Add(-time.Microsecond), true, false},
			purgeRow{"v4 at the cutoff", c, uuid.New(), cutoff, false, false},
			purgeRow{"v4 unexpired", c, uuid.New(), now, false, false},
			purgeRow{"v4 below the bound, unexpired", c, v4Low(), cutoff.Add(time.Minute), false, false},
			purgeRow{"v4 below the bound, expired", c, v4Low(), cutoff.Add(-time.Minute), true, false},
			// The lean claim's UUIDv7 rows: no event_at, dated by their id.
			purgeRow{"lean v7 expired long ago", c, v7Ms(m - 3_600_000), time.Time{}, true, true},
			purgeRow{"lean v7 expired 1 ms before", c, v7Ms(m - 1), time.Time{}, true, true},
			purgeRow{"lean v7 of the cutoff's ms", c, v7Ms(m), time.Time{}, false, true},
			purgeRow{"lean v7 1 ms after", c, v7Ms(m + 1), time.Time{}, false, true},
			purgeRow{"lean v7 fresh", c, v7Ms(now.UnixMilli()), time.Time{}, false, true},
			// A v4 row without event_at (a release before migration 2
			// under an old default): its time is unknown, never purged.
			purgeRow{"v4 below the bound, no event_at", c, v4Low(), time.Time{}, false, true},
		)
	}
	// Committed by another connection after tx began (READ COMMITTED: the
	// purge's statement sees them).
	b := &pgx.Batch{}
	for _, r := range rows {
		var at any = r.at
		if r.noAt {
			at = nil
		}
		b.Queue(`INSERT INTO processed_event (consumer, event_id, event_at) VALUES ($1, $2, $3)`, r.consumer, r.id, at)
	}
	require.NoError(t, pool.SendBatch(ctx, b).Close())

	// Rows locked elsewhere: one expired UUIDv7 and one expired v4.
	lockedV7, lockedV4 := rows[0], rows[9]
	require.True(t, lockedV7.gone && lockedV4.gone)
	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = other.Rollback(ctx) }()
	for _, r := range []purgeRow{lockedV7, lockedV4} {
		_, err := other.Exec(ctx, `SELECT 1 FROM processed_event WHERE consumer = $1 AND event_id = $2 FOR UPDATE`, r.consumer, r.id)
		require.NoError(t, err)
	}

	want := 0
	for _, r := range rows {
		if r.gone {
			want++
		}
	}
	want -= 2 // the locked ones
	// Batches of 4 until one comes back short, as the Purger does.
	total := 0
	for {
		n, err := s.PurgeBatch(ctx, sqldb.Pgx(tx), time.Hour, 4)
		require.NoError(t, err)
		require.LessOrEqual(t, n, int64(4), "bounded by the batch size")
		total += int(n)
		if n < 4 {
			break
		}
	}
	require.Equal(t, want, total)
	for _, r := range rows {
		ok, err := s.Processed(ctx, sqldb.Pgx(tx), r.consumer, r.id)
		require.NoError(t, err)
		locked := r == lockedV7 || r == lockedV4
		require.Equal(t, !r.gone || locked, ok, "%s/%s (event_at %s, cutoff %s)", r.consumer, r.name, r.at.Format(time.RFC3339Nano), cutoff.Format(time.RFC3339Nano))
	}
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, other.Rollback(ctx))

	// Once released, the locked rows go too (a later cutoff: nothing
	// unexpired then either).
	n, err := s.PurgeBatch(ctx, sqldb.Pgx(pool), time.Hour, 100)
	require.NoError(t, err)
	require.GreaterOrEqual(t, n, int64(2))
	for _, r := range []purgeRow{lockedV7, lockedV4} {
		ok, err := s.Processed(ctx, sqldb.Pgx(pool), r.consumer, r.id)
		require.NoError(t, err)
		require.False(t, ok, r.name)
	}
}

// planNodes returns every node type of an EXPLAIN (FORMAT JSON) plan with
// the relation and index it reads.
func planNodes(t *testing.T, pool *pgxpool.Pool, query string, args ...any) []string {
	t.Helper()
	var doc []struct{ Plan map[string]any }
	var raw []byte
	require.NoError(t, pool.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON) "+query, args...).Scan(&raw))
	require.NoError(t, json.Unmarshal(raw, &doc))
	var out []string
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		out = append(out, fmt.Sprintf("%v on %v using %v", n["Node Type"], n["Relation Name"], n["Index Name"]))
		if kids, ok := n["Plans"].([]any); ok {
			for _, k := range kids {
				walk(k.(map[string]any))
			}
		}
	}
	walk(doc[0].Plan)
	return out
}

// On a table of 55k rows (50k UUIDv7 over five consumers, a few percent
// expired, 5k v4), the purge's plan reads the event_at index and deletes by
// the primary key: no sequential scan. The assertion is on the plan's node
// types, not on timings.
func TestPlainPurgePlanUsesIndexes(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStore(t, sqldb.Pgx(pool))
	_, err := pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
SELECT 'c' || (i % 5), (lpad(to_hex(ms), 12, '0') || '7' || substr(md5(i::text), 1, 3) || '8' || substr(md5(i::text), 4, 15))::uuid,
       to_timestamp(ms / 1000.0::float8)
FROM (SELECT i, (extract(epoch FROM now() - interval '65 minutes') * 1000)::bigint + i * 78 AS ms
      FROM generate_series(1, 50000) AS i) AS s`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO processed_event (consumer, event_id, event_at)
SELECT 'c' || (i % 5), gen_random_uuid(), now() - i * interval '1 second' FROM generate_series(1, 5000) AS i`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `ANALYZE processed_event`)
	require.NoError(t, err)

	nodes := planNodes(t, pool, processedstore.PurgeSQL(s), time.Hour.Microseconds(), 100)
	t.Logf("plan:\n%v", nodes)
	var pkey, eventAt bool
	for _, n := range nodes {
		require.NotContains(t, n, "Seq Scan", "plan: %v", nodes)
		if strings.HasSuffix(n, " using processed_event_pkey") {
			pkey = true
		}
		if strings.HasSuffix(n, " using processed_event_event_at_set_idx") {
			eventAt = true
		}
	}
	require.True(t, pkey, "rows are deleted by the primary key: %v", nodes)
	require.True(t, eventAt, "expired rows are found through the event_at index: %v", nodes)

	// One transaction: the purge and the count share now().
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var expired int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_at < now() - interval '1 hour'`).Scan(&expired))
	n, err := s.PurgeBatch(ctx, sqldb.Pgx(tx), time.Hour, 100_000)
	require.NoError(t, err)
	require.EqualValues(t, expired, n)
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_at < now() - interval '1 hour'`).Scan(&expired))
	require.Zero(t, expired)
	require.Greater(t, n, int64(1000))
}
