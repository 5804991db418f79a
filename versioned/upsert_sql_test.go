package versioned

import (
	"testing"

	"github.com/stretchr/testify/require"
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
	require.Equal(t, `INSERT INTO "shop"."Stock" AS cur ("warehouse", "sku", "version", "qty", "note")`+
		` VALUES ($1, $2, $3, $4, $5)`+
		` ON CONFLICT ("warehouse", "sku")`+
		` DO UPDATE SET "version" = EXCLUDED."version", "qty" = EXCLUDED."qty", "note" = EXCLUDED."note"`+
		` WHERE cur."version" IS NULL OR cur."version" < EXCLUDED."version"`+
		` RETURNING (cur.xmax = 0) AS inserted`, u.query)

	u, err = NewUpsert(UpsertConfig{Table: "seen", KeyColumns: []string{"id"}, VersionColumn: "v"})
	require.NoError(t, err)
	require.Equal(t, `INSERT INTO "seen" AS cur ("id", "v") VALUES ($1, $2)`+
		` ON CONFLICT ("id") DO UPDATE SET "v" = EXCLUDED."v"`+
		` WHERE cur."v" IS NULL OR cur."v" < EXCLUDED."v"`+
		` RETURNING (cur.xmax = 0) AS inserted`, u.query)
}
