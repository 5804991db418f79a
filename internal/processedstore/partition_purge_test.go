package processedstore_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Hostile cases of the partitioned layout's maintenance (issue 16): the
// rule is that no partition is dropped while a redelivery of one of its
// events could still be accepted, no claim is lost, and maintenance never
// fails the same way run after run.

func partitionedStore(t *testing.T, span, horizon time.Duration) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Layout: processedstore.LayoutPartitioned, PartitionSpan: span, Horizon: horizon, MaxFutureSkew: time.Minute})
	require.NoError(t, err)
	return s
}

func dbNow(t *testing.T, pool *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT now()`).Scan(&now))
	return now
}

// claimTx claims in its own committed transaction.
func claimTx(t *testing.T, pool *pgxpool.Pool, s *processedstore.Store, consumer string, id uuid.UUID) (bool, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	ok, err := s.ClaimAt(ctx, sqldb.Pgx(tx), consumer, id, time.Time{})
	if err == nil {
		require.NoError(t, tx.Commit(ctx))
	}
	return ok, err
}

// coverage returns the time partitions' [from, to) ranges (as UUIDv7 times,
// milliseconds) sorted, read from the catalog.
func coverage(t *testing.T, pool *pgxpool.Pool, table string) [][2]time.Time {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass`, table)
	require.NoError(t, err)
	defer rows.Close()
	var out [][2]time.Time
	for rows.Next() {
		var b string
		require.NoError(t, rows.Scan(&b))
		var lo, hi string
		if _, err := fmt.Sscanf(b, "FOR VALUES FROM ('%36s') TO ('%36s')", &lo, &hi); err != nil {
			continue // DEFAULT
		}
		out = append(out, [2]time.Time{uuidTime(uuid.MustParse(lo)), uuidTime(uuid.MustParse(hi))})
	}
	require.NoError(t, rows.Err())
	sort.Slice(out, func(i, j int) bool { return out[i][0].Before(out[j][0]) })
	return out
}

func uuidTime(id uuid.UUID) time.Time {
	var ms int64
	for i := 0; i < 6; i++ {
		ms = ms<<8 | int64(id[i])
	}
	return time.UnixMilli(ms).UTC()
}

// requireCovered: every millisecond of [from, to) is in exactly one time
// partition (no gap: a claim there would land in the default partition; no
// overlap: PostgreSQL forbids it anyway).
func requireCovered(t *testing.T, parts [][2]time.Time, from, to time.Time) {
	t.Helper()
	at := from
	for _, p := range parts {
		if !p[1].After(at) {
			continue
		}
		require.False(t, p[0].After(at), "gap in the partitions at %s (partitions %v)", at, parts)
		at = p[1]
		if !at.Before(to) {
			return
		}
	}
	require.False(t, at.Before(to), "partitions end at %s, before %s", at, to)
}

// A partition is judged by its own bounds, read from the catalog, not by
// the span of the store that judges it: a partition made by an earlier
// configuration with a longer span (here 2 h, judged by a 1 h store) whose
// first hour has expired still holds events inside the horizon. The code
// before this test read the span start from the name and added the current
// span: it dropped the partition, and the redelivery of an event still
// inside the horizon was claimed (applied) again.
func TestPartitionDropJudgesEachPartitionsOwnBounds(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := partitionedStore(t, time.Hour, 2*time.Hour)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	now := dbNow(t, pool)
	start := now.UTC().Truncate(time.Minute).Add(-3 * time.Hour) // [now-3h, now-1h): its second hour is inside the horizon
	name := "processed_event_p" + start.Format("200601021504")
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
		name, bound(start), bound(start.Add(2*time.Hour))))
	require.NoError(t, err)
	inside := v7(start.Add(100 * time.Minute)) // 80 min old: the claim accepts its redelivery
	ok, err := claimTx(t, pool, s, "c", inside)
	require.NoError(t, err)
	require.True(t, ok)

	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
	require.NoError(t, err)
	_, _, err = p.PurgeNow(ctx)
	require.NoError(t, err)
	ok, err = claimTx(t, pool, s, "c", inside)
	require.NoError(t, err)
	require.False(t, ok, "the redelivery of an event inside the horizon is a duplicate: its partition must not be dropped")

	// A partition of any name whose range is wholly past the horizon goes.
	old := now.UTC().Add(-5 * time.Hour).Truncate(time.Minute)
	_, err = pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE processed_event_archive PARTITION OF processed_event FOR VALUES FROM ('%s') TO ('%s')`,
		bound(old), bound(old.Add(90*time.Minute))))
	require.NoError(t, err)
	rep, err := s.MaintainPartitions(ctx, sqldb.Pgx(pool), 2*time.Hour)
	require.NoError(t, err)
	require.Empty(t, rep.Skipped)
	require.Contains(t, rep.Dropped, "processed_event_archive")
	require.NotContains(t, rep.Dropped, name)
}

// Spans that divide no hour or day, and a span changed between two runs
// (60 min, then 45 min; 7 min; 25 h): the partitions ahead stay contiguous
// from the current span to now + MaxFutureSkew + 3 spans, and no run reports
// an error. The code before this test created each new span whole: after a
// span change every span overlapping an existing partition failed
// ("would overlap partition"), on every run (an error logged each minute),
// leaving gaps.
func TestPartitionSpansNotDividingAnHourStayContiguous(t *testing.T) {
	t.Parallel()
	for _, spans := range [][]time.Duration{{time.Hour, 45 * time.Minute}, {7 * time.Minute}, {25 * time.Hour}, {45 * time.Minute, time.Hour, 7 * time.Minute}} {
		t.Run(fmt.Sprint(spans), func(t *testing.T) {
			t.Parallel()
			pool, _ := testenv.Pool(t)
			ctx := context.Background()
			for i, span := range spans {
				s := partitionedStore(t, span, 2*time.Hour)
				require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
				for run := 0; run < 2; run++ {
					rep, err := s.MaintainPartitions(ctx, sqldb.Pgx(pool), 2*time.Hour)
					require.NoError(t, err)
					require.Empty(t, rep.Skipped, "span %s (config %d), run %d", span, i, run)
					if run == 1 {
						require.Empty(t, rep.Created, "the second run has nothing to create")
					}
				}
				now := dbNow(t, pool)
				requireCovered(t, coverage(t, pool, "processed_event"), now, now.Add(time.Minute+3*span))
				id := v7(now.Add(30 * time.Second))
				ok, err := claimTx(t, pool, s, fmt.Sprint("c", i), id)
				require.NoError(t, err)
				require.True(t, ok)
				var rel string
				require.NoError(t, pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1 AND consumer = $2`, id, fmt.Sprint("c", i)).Scan(&rel))
				require.NotEqual(t, "processed_event_default", rel, "a current event lands in a time partition")
			}
		})
	}
}

// Claims that landed in the default partition for a span that had no
// partition yet (the purger was stopped) keep that span from being created
// (PostgreSQL refuses a partition whose range rows of the default partition
// fall in, SQLSTATE 23514). That is no error: the rows stay in the default
// partition (purged by DELETE), the span is not created, and the rows stay
// found. The code before this test reported the failed CREATE on every run
// while the span was ahead (an error logged each minute for hours).
func TestPartitionDefaultRowsOfASpanAreNoErrorLoop(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := partitionedStore(t, time.Hour, 2*time.Hour)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	now := dbNow(t, pool)
	// As if the purger had stopped for more than the spans ahead: the span
	// of the event claimed next has no partition (Migrate created it; drop
	// it). The event's own span, not now's: 30 s before an hour ends they
	// differ.
	at := now.Add(30 * time.Second)
	_, err := pool.Exec(ctx, `DROP TABLE processed_event_p`+at.UTC().Truncate(time.Hour).Format("200601021504"))
	require.NoError(t, err)
	early := v7(at) // no partition: default
	ok, err := claimTx(t, pool, s, "c", early)
	require.NoError(t, err)
	require.True(t, ok)
	for run := 0; run < 2; run++ {
		rep, err := s.MaintainPartitions(ctx, sqldb.Pgx(pool), 2*time.Hour)
		require.NoError(t, err)
		require.Empty(t, rep.Skipped, "run %d", run)
		require.Len(t, rep.Waiting, 1, "the span of the default partition's row waits")
	}
	ok, err = claimTx(t, pool, s, "c", early)
	require.NoError(t, err)
	require.False(t, ok, "still found")
	// Covered from the span after the dropped one (at's, which is now's next
	// span when now is in an hour's last 30 s).
	requireCovered(t, coverage(t, pool, "processed_event"), at.Truncate(time.Hour).Add(time.Hour), now.Add(time.Minute+3*time.Hour))
	var rel string
	require.NoError(t, pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1`, early).Scan(&rel))
	require.Equal(t, "processed_event_default", rel)
}

// Process TZ and session TimeZone far from UTC (+13:45, −03:30, with DST),
// a producer clock ahead of the database by more than the spans created,
// an event older than any partition, an event exactly at a partition
// bound: each lands where the rule says and nothing current is dropped.
func TestPartitionsWhateverTheClocks(t *testing.T) {
	// Not parallel: it sets the process's time.Local.
	chatham, err := time.LoadLocation("Pacific/Chatham")
	require.NoError(t, err)
	saved := time.Local
	time.Local = chatham
	t.Cleanup(func() { time.Local = saved })
	for _, tz := range []string{"Pacific/Chatham", "America/St_Johns", "UTC"} {
		t.Run(tz, func(t *testing.T) {
			schema := testenv.Schema(t)
			cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 4)
			cfg.ConnConfig.RuntimeParams["timezone"] = tz
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			ctx := context.Background()
			const span, horizon = 30 * time.Minute, 2 * time.Hour
			s := partitionedStore(t, span, horizon)
			require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
			p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{}, nil)
			require.NoError(t, err)
			_, _, err = p.PurgeNow(ctx)
			require.NoError(t, err)
			now := dbNow(t, pool)
			where := func(id uuid.UUID) string {
				var rel string
				require.NoError(t, pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1`, id).Scan(&rel))
				return rel
			}
			cur := now.UTC().Truncate(span) // the current span's lower bound
			at := v7(cur)
			ok, err := claimTx(t, pool, s, "c", at)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, "processed_event_p"+cur.Format("200601021504"), where(at), "an event exactly at a bound is in the partition starting there")
			before := v7(cur.Add(-time.Millisecond)) // the span before: no partition (created from the current span on)
			ok, err = claimTx(t, pool, s, "c", before)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, "processed_event_default", where(before))
			// Ahead of the database by more than the spans created: refused.
			_, err = claimTx(t, pool, s, "c", v7(now.Add(time.Minute+5*span)))
			require.ErrorIs(t, err, processedstore.ErrFuture)
			// Older than any partition, inside the horizon: the default.
			oldest := v7(now.Add(-horizon + 10*time.Minute))
			ok, err = claimTx(t, pool, s, "c", oldest)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, "processed_event_default", where(oldest))
			_, err = claimTx(t, pool, s, "c", v7(now.Add(-horizon-time.Minute)))
			require.ErrorIs(t, err, processedstore.ErrExpired)
			_, _, err = p.PurgeNow(ctx)
			require.NoError(t, err)
			for _, id := range []uuid.UUID{at, before, oldest} {
				ok, err := claimTx(t, pool, s, "c", id)
				require.NoError(t, err)
				require.False(t, ok, "found after the purge")
			}
		})
	}
}

// Two purgers on two pools (two processes) at once, with claims going on:
// no error, no claim lost, the partitions ahead contiguous.
func TestPartitionTwoPurgersAtOnce(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	other := testenv.PoolOn(t, schema, 4)
	ctx := context.Background()
	const span = 7 * time.Minute
	s1 := partitionedStore(t, span, 2*time.Hour)
	s2 := partitionedStore(t, span, 2*time.Hour)
	require.NoError(t, s1.Migrate(ctx, sqldb.Pgx(pool)))
	p1, err := processedstore.NewPurger(s1, sqldb.PgxPool(pool), processedstore.PurgerConfig{BatchSize: 10}, nil)
	require.NoError(t, err)
	p2, err := processedstore.NewPurger(s2, sqldb.PgxPool(other), processedstore.PurgerConfig{BatchSize: 10}, nil)
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for _, p := range []*processedstore.Purger{p1, p2} {
		wg.Add(1)
		go func(p *processedstore.Purger) {
			defer wg.Done()
			for i := 0; i < 10; i++ {
				if _, _, err := p.PurgeNow(ctx); err != nil {
					errs <- err
				}
			}
		}(p)
	}
	var ids []uuid.UUID
	for i := 0; i < 40; i++ {
		id := uuid.Must(uuid.NewV7())
		ok, err := claimTx(t, pool, s1, "c", id)
		require.NoError(t, err)
		require.True(t, ok)
		ids = append(ids, id)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, id := range ids {
		ok, err := claimTx(t, other, s2, "c", id)
		require.NoError(t, err)
		require.False(t, ok)
	}
	now := dbNow(t, pool)
	requireCovered(t, coverage(t, pool, "processed_event"), now, now.Add(time.Minute+3*span))
}

// Migrate with LayoutPartitioned on a table the plain layout created must
// not pass silently: the store would route ids to a side table that does
// not exist and the purger would fail to partition a plain table on every
// run. The code before this test recorded nothing new and returned nil
// (the plain table's version 1 counted as the partitioned one's).
func TestPartitionedMigrateOnPlainTableIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	plain, err := processedstore.NewStore(processedstore.Config{Horizon: 2 * time.Hour})
	require.NoError(t, err)
	require.NoError(t, plain.Migrate(ctx, sqldb.Pgx(pool)))
	s := partitionedStore(t, time.Hour, 2*time.Hour)
	err = s.Migrate(ctx, sqldb.Pgx(pool))
	require.ErrorIs(t, err, processedstore.ErrPlainTable)
}

// A table partitioned by its user by range on event_at must carry event_at
// in its primary key (PostgreSQL requires the partition key in every
// unique index), so (consumer, event_id) is no longer unique: two claims of
// one event dated differently (an id that is not a UUIDv7, dated by the
// claim's now()) both insert, and the effect is applied twice. Migrate
// refuses such a table (ErrNoGlobalKey); the code before this test accepted
// it, and the second claim below inserted a second row.
func TestUserRangeOnEventAtIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE processed_event (
    consumer text NOT NULL, event_id uuid NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
    event_at timestamptz NOT NULL DEFAULT now(), event_name text, fingerprint bytea,
    PRIMARY KEY (consumer, event_id, event_at)) PARTITION BY RANGE (event_at);
CREATE TABLE processed_event_all PARTITION OF processed_event FOR VALUES FROM (MINVALUE) TO (MAXVALUE)`)
	require.NoError(t, err)
	s, err := processedstore.NewStore(processedstore.Config{Horizon: 2 * time.Hour})
	require.NoError(t, err)
	err = s.Migrate(ctx, sqldb.Pgx(pool))
	require.ErrorIs(t, err, processedstore.ErrNoGlobalKey)

	// What it prevents: the same event claimed twice.
	id := uuid.New()
	for i := 0; i < 2; i++ {
		ok, _ := claimTx(t, pool, s, "c", id)
		if i == 1 {
			require.True(t, ok, "without the check the second claim inserts: the reason Migrate refuses the table")
		}
	}
	// Hash or range on event_id or consumer keep the key: accepted.
	pool2, _ := testenv.Pool(t)
	_, err = pool2.Exec(ctx, `CREATE TABLE processed_event (
    consumer text NOT NULL, event_id uuid NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
    event_at timestamptz NOT NULL DEFAULT now(), event_name text, fingerprint bytea,
    PRIMARY KEY (consumer, event_id)) PARTITION BY HASH (event_id);
CREATE TABLE processed_event_h0 PARTITION OF processed_event FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE processed_event_h1 PARTITION OF processed_event FOR VALUES WITH (MODULUS 2, REMAINDER 1)`)
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool2)))
}
