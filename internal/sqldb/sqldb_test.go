package sqldb_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

func TestParseIdent(t *testing.T) {
	t.Parallel()
	id, err := sqldb.ParseIdent("inbox.processed_event")
	require.NoError(t, err)
	require.Equal(t, `"inbox"."processed_event"`, id.Quoted('"'))
	require.Equal(t, "`inbox`.`processed_event`", id.Quoted('`'))
	require.Equal(t, "processed_event", id.Name())
	require.Equal(t, "inbox.processed_event", id.String())
	for _, bad := range []string{"", "a.b.c", `x"y`, "x`y", "1a", "a b", "a;drop", "é", string(make([]byte, 64))} {
		_, err := sqldb.ParseIdent(bad)
		require.Error(t, err, "%q", bad)
	}
}

func TestSplitStatements(t *testing.T) {
	t.Parallel()
	got := sqldb.SplitStatements("-- comment\nCREATE TABLE a (\n  x int\n);\n\nCREATE INDEX i ON a (x);\n")
	require.Equal(t, []string{"CREATE TABLE a (\n  x int\n)", "CREATE INDEX i ON a (x)"}, got)
}

func TestNoRowsIsOneSentinel(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.Pool(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(schema))
	require.NoError(t, err)
	defer db.Close()
	for name, q := range map[string]sqldb.Querier{"pgx": sqldb.Pgx(pool), "std": sqldb.Std(db)} {
		var x int
		err := q.QueryRow(context.Background(), "SELECT 1 WHERE false").Scan(&x)
		require.ErrorIs(t, err, sqldb.ErrNoRows, name)
		require.True(t, errors.Is(err, pgx.ErrNoRows) || errors.Is(err, sql.ErrNoRows), name)
		n, err := q.Exec(context.Background(), "SELECT 1")
		require.NoError(t, err)
		require.EqualValues(t, 1, n, name)
	}
}
