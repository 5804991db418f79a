package processedstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// v7Store is a migrated store on schema's processed_event (qualified, as
// NewConsumer names it) whose UUIDv7 claims go to processed_event_v7 for
// consumer.
func v7Store(t *testing.T, pool *pgxpool.Pool, schema, consumer string) *processedstore.Store {
	t.Helper()
	ctx := context.Background()
	s, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, s.Migrate(ctx, sqldb.Pgx(pool)))
	require.NoError(t, s.CheckLean(ctx, sqldb.Pgx(pool), consumer))
	return s
}

// claimV7 runs s's pgx claim of id for consumer (the statement the pgx
// beginner prepares) in its own transaction and reports whether it
// inserted the row.
func claimV7(t *testing.T, pool *pgxpool.Pool, s *processedstore.Store, consumer string, id uuid.UUID) bool {
	t.Helper()
	p, ok := s.ClaimParamsAt(consumer, id, time.Time{}, nil)
	require.True(t, ok)
	require.NotZero(t, p.ConsumerID, "claimed in the v7 table")
	tag, err := pool.Exec(context.Background(), p.SQL, p.ConsumerID, id, p.EventAt)
	require.NoError(t, err)
	return tag.RowsAffected() == 1
}

// The purger deletes the rows of processed_event_v7 whose id's time is
// before its cutoff (the horizon and the claim's slack before the
// database clock), for every consumer, and keeps the others.
func TestPurgerDeletesExpiredRowsOfTheV7TableOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	s := v7Store(t, pool, schema, "orders")
	v7Store(t, pool, schema, "stock")
	now := dbNow(t, pool)
	cutoff := now.Add(-time.Hour - 5*time.Minute) // the purger's (horizon + purgeClaimSlack)
	var expired, kept []uuid.UUID
	for _, c := range []string{"orders", "stock"} {
		for _, at := range []time.Time{cutoff.Add(-24 * time.Hour), cutoff.Add(-time.Minute)} {
			id := v7At(at)
			expired = append(expired, id)
			_, err := pool.Exec(ctx, `INSERT INTO processed_event_v7 (consumer, event_id) SELECT id, $2 FROM processed_event_consumer WHERE name = $1`, c, id)
			require.NoError(t, err)
		}
		for _, at := range []time.Time{cutoff.Add(time.Minute), now} {
			id := v7At(at)
			kept = append(kept, id)
			_, err := pool.Exec(ctx, `INSERT INTO processed_event_v7 (consumer, event_id) SELECT id, $2 FROM processed_event_consumer WHERE name = $1`, c, id)
			require.NoError(t, err)
		}
	}
	p, err := processedstore.NewPurger(s, sqldb.PgxPool(pool), processedstore.PurgerConfig{Horizon: time.Hour, BatchSize: 1}, nil)
	require.NoError(t, err)
	n, ran, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.True(t, ran)
	require.EqualValues(t, len(expired), n)
	var left []uuid.UUID
	rows, err := pool.Query(ctx, `SELECT event_id FROM processed_event_v7`)
	require.NoError(t, err)
	for rows.Next() {
		var id uuid.UUID
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	require.NoError(t, rows.Err())
	require.ElementsMatch(t, kept, left)
}

// A consumer name that claimed events through the table before any
// process of this release registered it (a consumer of the previous
// release started after the migration) is registered by the trigger, which
// copies those claims into processed_event_v7, so the claims of this
// release's consumer of that name are duplicates there. The operators'
// lookup shows each such row once.
func TestClaimsOfAnUnregisteredNameInTheTableAreDuplicatesInTheV7Table(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	old := v7Store(t, pool, schema, "")
	var ids []uuid.UUID
	for i := 0; i < 5; i++ {
		id := uuid.Must(uuid.NewV7())
		ids = append(ids, id)
		ok, err := old.Claim(ctx, sqldb.Pgx(pool), "late", id) // the table's claim
		require.NoError(t, err)
		require.True(t, ok)
	}
	var inV7 int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event_v7`).Scan(&inV7))
	require.Equal(t, len(ids), inV7, "copied by the trigger, which registered the name")

	s := v7Store(t, pool, schema, "late")
	for _, id := range ids {
		require.False(t, claimV7(t, pool, s, "late", id), "a duplicate")
		done, err := s.Processed(ctx, sqldb.Pgx(pool), "late", id)
		require.NoError(t, err)
		require.True(t, done)
	}
	fresh := uuid.Must(uuid.NewV7())
	require.True(t, claimV7(t, pool, s, "late", fresh))
	require.False(t, claimV7(t, pool, s, "late", fresh))
	// The table's claim of the same event: a duplicate too, found there.
	ok, err := old.Claim(ctx, sqldb.Pgx(pool), "late", fresh)
	require.NoError(t, err)
	require.False(t, ok)
	done, err := old.Processed(ctx, sqldb.Pgx(pool), "late", fresh)
	require.NoError(t, err)
	require.True(t, done)

	// The lookup: one row per (consumer, event), whichever tables hold it.
	other := uuid.Must(uuid.NewV7())
	require.True(t, claimV7(t, pool, s, "late", other))
	tool, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event"})
	require.NoError(t, err)
	require.NoError(t, tool.ReadLegacy(ctx, sqldb.Pgx(pool)))
	for _, id := range []uuid.UUID{ids[0], fresh, other} {
		q, args := tool.LookupQuery(id, "")
		rows, err := pool.Query(ctx, q, args...)
		require.NoError(t, err)
		n := 0
		for rows.Next() {
			var consumer string
			var at *time.Time // NULL for a row of the v7 table (it keeps no time; the server records no commit time)
			require.NoError(t, rows.Scan(&consumer, &at))
			require.Equal(t, "late", consumer)
			n++
		}
		require.NoError(t, rows.Err())
		require.Equal(t, 1, n, "event %s", id)
	}
}

// A claim made in the table in a REPEATABLE READ transaction (as
// watermill-sql's subscriber begins its own) whose snapshot predates the
// registration of its consumer's name (a process of this release
// starting, or Migrate's copy) fails (40001) instead of leaving the claim
// out of processed_event_v7: the trigger's registration meets the name
// committed after the snapshot. Delivered again in a new transaction, it
// is copied, and it is a duplicate for this release's claim.
func TestRepeatableReadClaimWhoseSnapshotPredatesTheRegistrationFailsOnce(t *testing.T) {
	t.Parallel()
	for _, registration := range []string{"start", "migrate"} {
		t.Run(registration, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool, schema := testenv.Pool(t)
			table := schema + ".processed_event"
			old, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
			require.NoError(t, err)
			ms, err := old.Migrations()
			require.NoError(t, err)
			if registration == "migrate" {
				// The previous release's table (migrations 1 to 7), where
				// "late" has claimed: Migrate registers the name.
				require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+old.Table().String(), ms[:7]))
				ok, err := old.Claim(ctx, sqldb.Pgx(pool), "late", uuid.Must(uuid.NewV7()))
				require.NoError(t, err)
				require.True(t, ok)
			} else {
				require.NoError(t, old.Migrate(ctx, sqldb.Pgx(pool)))
			}

			tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, `SELECT 1`) // the snapshot
			require.NoError(t, err)

			if registration == "migrate" {
				require.NoError(t, old.Migrate(ctx, sqldb.Pgx(pool)))
			}
			s := v7Store(t, pool, schema, "late")
			id := uuid.Must(uuid.NewV7())
			_, err = old.Claim(ctx, sqldb.Pgx(tx), "late", id)
			var pgErr *pgconn.PgError
			require.ErrorAs(t, err, &pgErr)
			require.Equal(t, "40001", pgErr.Code)
			require.NoError(t, tx.Rollback(ctx))

			ok, err := old.Claim(ctx, sqldb.Pgx(pool), "late", id)
			require.NoError(t, err)
			require.True(t, ok, "delivered again: claimed")
			require.False(t, claimV7(t, pool, s, "late", id), "a duplicate for this release")
		})
	}
}
