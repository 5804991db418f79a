package versioned_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// versioned/doc.go: "nil keys (ErrKeyMissing) are permanent too"; upsert.go:
// "ErrKeyMissing ... a NULL key would never conflict with a unique
// constraint and would add a row per event". A key that the driver binds as
// NULL through driver.Valuer (sql.NullString{}, pgtype.Text{}) must be
// refused too: bound as NULL, each Apply inserted a row, and a lower
// version was written after a higher one.
func TestUpsertRefusesAKeyBoundAsNULLByItsValuer(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE copy_h7 (k text UNIQUE, version bigint, v text)`)
	require.NoError(t, err)
	up, err := versioned.NewUpsert(versioned.UpsertConfig{Table: "copy_h7", KeyColumns: []string{"k"}, VersionColumn: "version", ValueColumns: []string{"v"}})
	require.NoError(t, err)

	v2, v1 := int64(2), int64(1)
	_, err2 := up.Apply(ctx, idempotency.PgxTx(pool), []any{sql.NullString{}}, &v2, []any{"new"})
	out, err1 := up.Apply(ctx, idempotency.PgxTx(pool), []any{sql.NullString{}}, &v1, []any{"old"})
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM copy_h7`).Scan(&rows))
	require.ErrorIs(t, err2, versioned.ErrKeyMissing, "a key bound as NULL must be refused before any SQL; got rows in table: %d, version 1 after version 2: %s", rows, out)
	require.ErrorIs(t, err1, versioned.ErrKeyMissing, "version 1 after version 2 was %s", out)
}

// A key the driver binds as NULL through a pointer to a nil pointer (pgx and
// database/sql dereference pointers all the way down) is refused as well:
// it passed the check, which looked at the outer pointer only, and each
// Apply inserted a row under a NULL key.
func TestUpsertRefusesAKeyBoundAsNULLThroughPointers(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		tg.Exec(t, `CREATE TABLE copy_ptr (k varchar(64) UNIQUE, version bigint, v text)`)
		up, err := versioned.NewUpsert(versioned.UpsertConfig{Table: "copy_ptr", KeyColumns: []string{"k"},
			VersionColumn: "version", ValueColumns: []string{"v"}, Dialect: tg.Dialect})
		require.NoError(t, err)
		var none *string
		var invalid *sql.NullString = &sql.NullString{}
		for i, key := range []any{&none, &invalid} {
			version := int64(i + 1)
			_, err := up.Apply(ctx, testenv.AsTx(tg.DB), []any{key}, &version, []any{"x"})
			require.ErrorIs(t, err, versioned.ErrKeyMissing, "key %d (%T)", i, key)
		}
		var rows int
		require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM copy_ptr`).Scan(&rows))
		require.Zero(t, rows)
	})
}
