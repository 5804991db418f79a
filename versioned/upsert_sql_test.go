package versioned

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// TestUpsertSQLPostgres pins the statement text: one INSERT … ON CONFLICT with
// the version guard and the xmax flag, every identifier quoted, every value a
// parameter.
func TestUpsertSQLPostgres(t *testing.T) {
	t.Parallel()
	u, err := NewUpsert(UpsertConfig{
		Table:         "shop.Stock",
		KeyColumns:    []string{"warehouse", "sku"},
		VersionColumn: "version",
		ValueColumns:  []string{"qty", "note"},
	})
	require.NoError(t, err)
	require.Equal(t, modeReturning, u.stmt.mode)
	require.Equal(t, `INSERT INTO "shop"."Stock" AS cur ("warehouse", "sku", "version", "qty", "note")`+
		` VALUES ($1, $2, $3, $4, $5)`+
		` ON CONFLICT ("warehouse", "sku")`+
		` DO UPDATE SET "version" = EXCLUDED."version", "qty" = EXCLUDED."qty", "note" = EXCLUDED."note"`+
		` WHERE cur."version" IS NULL OR cur."version" < EXCLUDED."version"`+
		` RETURNING (cur.xmax = 0) AS inserted`, u.stmt.query)

	u, err = NewUpsert(UpsertConfig{Table: "seen", KeyColumns: []string{"id"}, VersionColumn: "v"})
	require.NoError(t, err)
	require.Equal(t, `INSERT INTO "seen" AS cur ("id", "v") VALUES ($1, $2)`+
		` ON CONFLICT ("id") DO UPDATE SET "v" = EXCLUDED."v"`+
		` WHERE cur."v" IS NULL OR cur."v" < EXCLUDED."v"`+
		` RETURNING (cur.xmax = 0) AS inserted`, u.stmt.query)
}

// TestUpsertSQLMySQL pins the MySQL statement (the same text for MySQL 8 and
// MariaDB): one INSERT … ON DUPLICATE KEY UPDATE, IF() per column with the
// version assigned last, the incoming values bound again (no VALUES(), no
// row alias), backquoted identifiers.
func TestUpsertSQLMySQL(t *testing.T) {
	t.Parallel()
	u, err := NewUpsert(UpsertConfig{
		Table:         "shop.Stock",
		KeyColumns:    []string{"warehouse", "sku"},
		VersionColumn: "version",
		ValueColumns:  []string{"qty", "note"},
		Dialect:       sqldb.MySQL,
	})
	require.NoError(t, err)
	require.Equal(t, modeAffected, u.stmt.mode)
	require.Equal(t, "INSERT INTO `shop`.`Stock` (`warehouse`, `sku`, `version`, `qty`, `note`)"+
		" VALUES (?, ?, ?, ?, ?)"+
		" ON DUPLICATE KEY UPDATE"+
		" `qty` = IF(`version` IS NULL OR `version` < ?, ?, `qty`),"+
		" `note` = IF(`version` IS NULL OR `version` < ?, ?, `note`),"+
		" `version` = IF(`version` IS NULL OR `version` < ?, ?, `version`)", u.stmt.query)
	require.Equal(t, []any{"w", "s", int64(7), 3, "n", int64(7), 3, int64(7), "n", int64(7), int64(7)},
		u.stmt.args([]any{"w", "s"}, 7, []any{3, "n"}))

	u, err = NewUpsert(UpsertConfig{Table: "seen", KeyColumns: []string{"id"}, VersionColumn: "v", Dialect: sqldb.MySQL})
	require.NoError(t, err)
	require.Equal(t, "INSERT INTO `seen` (`id`, `v`) VALUES (?, ?)"+
		" ON DUPLICATE KEY UPDATE `v` = IF(`v` IS NULL OR `v` < ?, ?, `v`)", u.stmt.query)
	require.Equal(t, []any{"a", int64(1), int64(1), int64(1)}, u.stmt.args([]any{"a"}, 1, nil))
}

// TestUpsertSQLSQLite pins the SQLite statements: an insert that does
// nothing on a conflict with the key, then the guarded update, both with
// numbered parameters so they take the same arguments.
func TestUpsertSQLSQLite(t *testing.T) {
	t.Parallel()
	u, err := NewUpsert(UpsertConfig{
		Table:         "main.Stock",
		KeyColumns:    []string{"warehouse", "sku"},
		VersionColumn: "version",
		ValueColumns:  []string{"qty", "note"},
		Dialect:       sqldb.SQLite,
	})
	require.NoError(t, err)
	require.Equal(t, modeInsertThenUpdate, u.stmt.mode)
	require.Nil(t, u.stmt.args)
	require.Equal(t, `INSERT INTO "main"."Stock" ("warehouse", "sku", "version", "qty", "note")`+
		` VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT ("warehouse", "sku") DO NOTHING`, u.stmt.query)
	require.Equal(t, `UPDATE "main"."Stock" SET "version" = ?3, "qty" = ?4, "note" = ?5`+
		` WHERE "warehouse" = ?1 AND "sku" = ?2 AND ("version" IS NULL OR "version" < ?3)`, u.stmt.update)
}
