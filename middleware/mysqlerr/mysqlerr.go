// Package mysqlerr classifies go-sql-driver/mysql errors (MySQL, MariaDB) for
// the idempotent middleware, which does not link the driver itself: set
// middleware.Config.Classifier = mysqlerr.Classify when the middleware runs
// on MySQL or MariaDB (NewStdBeginner over a "mysql" *sql.DB).
//
// Only typed server errors (*mysql.MySQLError) are classified, by their
// error number; connection failures of the middleware's own calls are
// infrastructure errors by origin whatever their type.
package mysqlerr

import (
	"errors"

	"github.com/go-sql-driver/mysql"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// Classify is a middleware.ErrorClassifier for go-sql-driver/mysql:
//
//   - ClassTransient: 1205 lock wait timeout, 1213 deadlock, 1040 too many
//     connections, 1053 server shutdown, 1927 connection killed, 2006/2013
//     server gone / lost connection, 1290 server running with --read-only
//     (or another option that forbids the statement), 1792 read-only
//     transaction, 1836 read-only mode, 1021 disk full, 1037/1038/1041 out
//     of memory;
//   - ClassConfiguration: 1146 table does not exist, 1054 unknown column,
//     1142/1143 table/column access denied, 1044/1045 access denied, 1049
//     unknown database;
//   - ClassOrdinary: everything else, and errors that are not MySQL errors.
func Classify(err error) middleware.Class {
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return middleware.ClassOrdinary
	}
	switch me.Number {
	case 1205, 1213, 1040, 1053, 1927, 2006, 2013, 1290, 1792, 1836, 1021, 1037, 1038, 1041:
		return middleware.ClassTransient
	case 1146, 1054, 1142, 1143, 1044, 1045, 1049:
		return middleware.ClassConfiguration
	}
	return middleware.ClassOrdinary
}

// IsTransient reports whether err is transient for the middleware, with
// MySQL error numbers classified by Classify:
// middleware.IsTransient(err) || Classify(err) == ClassTransient, unless
// err is permanent.
func IsTransient(err error) bool {
	if err == nil || middleware.IsPermanent(err) {
		return false
	}
	return middleware.IsTransient(err) || Classify(err) == middleware.ClassTransient
}

var _ middleware.ErrorClassifier = Classify
