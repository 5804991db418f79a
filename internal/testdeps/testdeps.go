// Package testdeps registers the database/sql drivers of the tests' MariaDB
// and SQLite targets (internal/testenv opens them by name): go-sql-driver/mysql
// as "mysql", modernc.org/sqlite as "sqlite", pgx's stdlib as "pgx".
//
// It is a module of its own so that the core module requires neither driver.
// Its go.mod also holds the requirements of the core's full test run
// (scripts/test.sh): the core's test files named _*_test.go import modules
// the core must not require (the broker adapters, goose, golang-migrate,
// the MySQL driver, Redis), and are compiled in the go.work workspace, where
// this module's requirements complete the core's (see the package full).
package testdeps

import (
	_ "github.com/go-sql-driver/mysql" // database/sql driver "mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	_ "modernc.org/sqlite"             // database/sql driver "sqlite"
)
