package versioned_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// The family purger deletes exactly the idle rows on a plain, a hash- and a
// range-partitioned latest table. Keyed by ctid (the code before this
// test), the partitioned tables lost active families: ctids repeat across
// partitions.
func TestFamilyPurgeEveryLayout(t *testing.T) {
	t.Parallel()
	layouts := map[string]string{
		"plain": `CREATE TABLE family_latest (LIKE tpl.family_latest INCLUDING DEFAULTS, PRIMARY KEY (family_kind, family_id))`,
		"hash": `CREATE TABLE family_latest (LIKE tpl.family_latest INCLUDING DEFAULTS, PRIMARY KEY (family_kind, family_id)) PARTITION BY HASH (family_id);
			CREATE TABLE family_latest_h0 PARTITION OF family_latest FOR VALUES WITH (MODULUS 3, REMAINDER 0);
			CREATE TABLE family_latest_h1 PARTITION OF family_latest FOR VALUES WITH (MODULUS 3, REMAINDER 1);
			CREATE TABLE family_latest_h2 PARTITION OF family_latest FOR VALUES WITH (MODULUS 3, REMAINDER 2)`,
		"range": `CREATE TABLE family_latest (LIKE tpl.family_latest INCLUDING DEFAULTS, PRIMARY KEY (family_kind, family_id)) PARTITION BY RANGE (family_kind);
			CREATE TABLE family_latest_r0 PARTITION OF family_latest FOR VALUES FROM (MINVALUE) TO ('k2');
			CREATE TABLE family_latest_r1 PARTITION OF family_latest FOR VALUES FROM ('k2') TO (MAXVALUE)`,
	}
	for name, ddl := range layouts {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool, _ := testenv.Pool(t)
			db := sqldb.Pgx(pool)
			ctx := context.Background()
			tpl := testenv.Schema(t)
			tplStore, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: tpl + ".family_latest", AppliedTable: tpl + ".family_applied"})
			require.NoError(t, err)
			require.NoError(t, tplStore.Migrate(ctx, idempotency.Pgx(pool)))
			_, err = pool.Exec(ctx, strings.ReplaceAll(ddl, "tpl.", tpl+"."))
			require.NoError(t, err)
			s := migratedFamiliesOn(t, testenv.Target{Dialect: sqldb.PostgreSQL, DB: db, Pgx: pool})

			// Two kinds × 60 families; idle and active interleaved
			// differently per kind so that the partitions' ctids collide.
			active := 0
			for k := 1; k <= 2; k++ {
				for i := 0; i < 60; i++ {
					f := versioned.Family{Kind: fmt.Sprintf("k%d", k), ID: fmt.Sprint(i)}
					_, err := s.Advance(ctx, db, f, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
					require.NoError(t, err)
					if (i+k)%2 == 0 {
						_, err = pool.Exec(ctx, `UPDATE family_latest SET updated_at = now() - interval '2 hours' WHERE family_kind = $1 AND family_id = $2`, f.Kind, f.ID)
						require.NoError(t, err)
					} else {
						active++
					}
				}
			}
			p, err := versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: 25}, nil)
			require.NoError(t, err)
			n, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran)
			require.EqualValues(t, 120-active, n)
			var left int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM family_latest WHERE updated_at > now() - interval '1 hour'`).Scan(&left))
			require.Equal(t, active, left, "every active family stays")
		})
	}
}

// A latest table its user partitioned by range on updated_at (the purge's
// column, a tempting choice) must carry updated_at in its primary key, so
// the family key is no longer unique and the upsert's ON CONFLICT never
// fires across partitions: one family gets two latest rows and an older
// event is applied after a newer one. Migrate refuses such a table
// (ErrNoFamilyKey); the code before this test accepted it.
func TestFamilyRangeOnUpdatedAtIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	tpl := testenv.Schema(t)
	tplStore, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: tpl + ".family_latest", AppliedTable: tpl + ".family_applied"})
	require.NoError(t, err)
	require.NoError(t, tplStore.Migrate(ctx, idempotency.Pgx(pool)))
	_, err = pool.Exec(ctx, strings.ReplaceAll(`CREATE TABLE family_latest (LIKE tpl.family_latest INCLUDING DEFAULTS, PRIMARY KEY (family_kind, family_id, updated_at)) PARTITION BY RANGE (updated_at);
		CREATE TABLE family_latest_all PARTITION OF family_latest FOR VALUES FROM (MINVALUE) TO (MAXVALUE)`, "tpl.", tpl+"."))
	require.NoError(t, err)
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	require.ErrorIs(t, s.Migrate(ctx, idempotency.Pgx(pool)), versioned.ErrNoFamilyKey)
}
