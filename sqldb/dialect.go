package sqldb

import "fmt"

// Dialect names the SQL dialect a store writes. Each package keeps the SQL text
// of every dialect in one file; the zero value is PostgreSQL.
type Dialect int

const (
	// PostgreSQL 13 or later, through pgx v5 or database/sql with pgx's stdlib.
	PostgreSQL Dialect = iota
)

// String returns the dialect's name ("postgres").
func (d Dialect) String() string {
	switch d {
	case PostgreSQL:
		return "postgres"
	default:
		return fmt.Sprintf("Dialect(%d)", int(d))
	}
}

// Validate reports an error for a dialect this version does not support.
func (d Dialect) Validate() error {
	switch d {
	case PostgreSQL:
		return nil
	default:
		return fmt.Errorf("unsupported dialect %s", d)
	}
}

// QuoteChar is the identifier quote character of the dialect.
func (d Dialect) QuoteChar() byte {
	return '"'
}
