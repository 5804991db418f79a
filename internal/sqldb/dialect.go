package sqldb

import "fmt"

// Dialect names the SQL dialect a store writes. Each package keeps the SQL text
// of every dialect in one file per dialect; the zero value is PostgreSQL.
type Dialect int

const (
	// PostgreSQL 13 or later, through pgx v5 or database/sql with pgx's
	// stdlib. Placeholders $1, $2, …
	PostgreSQL Dialect = iota
	// MySQL 8.0.13+ or MariaDB 10.11+, through database/sql with
	// go-sql-driver/mysql (DSN with parseTime=true). Placeholders ?.
	MySQL
	// SQLite 3.35+, through database/sql with the pure-Go modernc.org/sqlite
	// driver (no cgo). Placeholders ?.
	SQLite
)

// String returns the dialect's name: "postgres", "mysql", "sqlite"; it is
// also the name of each package's migrations directory for the dialect.
func (d Dialect) String() string {
	switch d {
	case PostgreSQL:
		return "postgres"
	case MySQL:
		return "mysql"
	case SQLite:
		return "sqlite"
	default:
		return fmt.Sprintf("Dialect(%d)", int(d))
	}
}

// Validate reports an error for a dialect this version does not support.
func (d Dialect) Validate() error {
	switch d {
	case PostgreSQL, MySQL, SQLite:
		return nil
	default:
		return fmt.Errorf("unsupported dialect %s", d)
	}
}

// QuoteChar is the identifier quote character of the dialect: '"' for
// PostgreSQL and SQLite, '`' for MySQL.
func (d Dialect) QuoteChar() byte {
	if d == MySQL {
		return '`'
	}
	return '"'
}
