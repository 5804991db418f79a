package sqldb_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"

	_ "modernc.org/sqlite" // database/sql driver "sqlite"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The driver seam: the library's stores take a sqldb.Querier, built from a
// pgx transaction or pool (sqldb.Pgx) or a database/sql one (sqldb.Std),
// and table names from configuration are validated identifiers quoted per
// dialect.
func ExampleStd() {
	dir, _ := os.MkdirTemp("", "sqldb-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "x.db"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	table, err := sqldb.ParseIdent("processed_event")
	if err != nil {
		panic(err)
	}
	q := sqldb.Std(db)
	ctx := context.Background()
	if _, err := q.Exec(ctx, "CREATE TABLE "+table.Quoted(sqldb.SQLite.QuoteChar())+" (id TEXT PRIMARY KEY)"); err != nil {
		panic(err)
	}
	n, _ := q.Exec(ctx, "INSERT INTO "+table.Quoted(sqldb.SQLite.QuoteChar())+" (id) VALUES (?), (?)", "a", "b")
	fmt.Println("inserted:", n)
	_, err = sqldb.ParseIdent("x; DROP TABLE y")
	fmt.Println("refused:", err != nil)
	fmt.Println(table.Quoted(sqldb.MySQL.QuoteChar()))
	// Output:
	// inserted: 2
	// refused: true
	// `processed_event`
}
