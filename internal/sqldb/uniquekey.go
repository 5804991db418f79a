package sqldb

import (
	"context"
	"fmt"
)

// HasUniqueKey reports whether the PostgreSQL table (quoted, possibly
// schema-qualified) has a unique index, total and on plain columns, whose
// key is exactly cols (in any order). The stores' ON CONFLICT statements
// rely on one: a table partitioned by a column outside that key (PostgreSQL
// requires the partition key in every unique index of a partitioned table)
// has none, and its inserts no longer conflict on the key. It reads
// pg_index and pg_attribute; other dialects are not supported.
func HasUniqueKey(ctx context.Context, q Querier, quotedTable string, cols ...string) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_index x WHERE x.indrelid = $1::regclass AND x.indisunique
    AND x.indnkeyatts = cardinality($2::text[]) AND x.indpred IS NULL AND x.indexprs IS NULL
    AND (SELECT array_agg(a.attname::text ORDER BY a.attname::text) FROM pg_attribute a
         WHERE a.attrelid = x.indrelid AND a.attnum = ANY (x.indkey::int2[]))
      = (SELECT array_agg(c ORDER BY c) FROM unnest($2::text[]) c))`, quotedTable, cols).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("read the unique keys of %s: %w", quotedTable, err)
	}
	return ok, nil
}
