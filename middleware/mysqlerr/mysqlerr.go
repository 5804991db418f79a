// Package mysqlerr classifies go-sql-driver/mysql errors (MySQL, MariaDB) for
// the idempotent middleware, which does not link the driver itself: set
// middleware.ConsumerConfig.Classifier = mysqlerr.Classify when the consumer runs
// on MySQL or MariaDB (idempotency.SQL(db, idempotency.MySQL) over
// go-sql-driver/mysql). A module of its own: go get
// github.com/watermill-idempotency/idempotency/middleware/mysqlerr.
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

// Classify is a middleware.ErrorClassifier for go-sql-driver/mysql. Each
// number was checked against the server's own list (MariaDB 10.11 `perror`,
// the MariaDB error-code reference and MySQL's server error reference):
//
//   - ClassTransient, the server's or the connection's state, not the
//     message:
//   - locks and transactions: 1205 ER_LOCK_WAIT_TIMEOUT, 1213
//     ER_LOCK_DEADLOCK, 1614 ER_XA_RBDEADLOCK, 1637
//     ER_TOO_MANY_CONCURRENT_TRXS, 1180 ER_ERROR_DURING_COMMIT, 1181
//     ER_ERROR_DURING_ROLLBACK;
//   - connections: 1040 ER_CON_COUNT_ERROR (too many connections), 1203
//     ER_TOO_MANY_USER_CONNECTIONS, 1135 ER_CANT_CREATE_THREAD, 1152
//     ER_ABORTING_CONNECTION, 1154-1161 ER_NET_* (read/write errors and
//     timeouts, packets out of order, uncompress, fcntl), 1184
//     ER_NEW_ABORTING_CONNECTION, 1927 ER_CONNECTION_KILLED (MariaDB), 4031
//     ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8.0.24+: disconnected for
//     inactivity; in MariaDB 4031 is ER_REFERENCED_TRG_DOES_NOT_EXIST, an
//     error of CREATE TRIGGER … FOLLOWS, which a message handler does not
//     run);
//   - shutdown: 1053 ER_SERVER_SHUTDOWN, 1077 ER_NORMAL_SHUTDOWN, 1079
//     ER_SHUTDOWN_COMPLETE, 1080 ER_FORCING_CLOSE;
//   - statements stopped by the server: 1317 ER_QUERY_INTERRUPTED (KILL
//     QUERY), 1969 ER_STATEMENT_TIMEOUT (MariaDB max_statement_time), 3024
//     ER_QUERY_TIMEOUT (MySQL max_execution_time; unused in MariaDB);
//   - writes refused: 1290 ER_OPTION_PREVENTS_STATEMENT (--read-only), 1792
//     ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, 1836 ER_READ_ONLY_MODE;
//   - resources: 1021 ER_DISK_FULL, 1114 ER_RECORD_FILE_FULL (table full),
//     1037 ER_OUTOFMEMORY, 1038 ER_OUT_OF_SORTMEMORY, 1041
//     ER_OUT_OF_RESOURCES, 1206 ER_LOCK_TABLE_FULL, 3019
//     ER_INNODB_UNDO_LOG_FULL;
//   - client-library codes some drivers and proxies report as server
//     errors (go-sql-driver/mysql itself returns mysql.ErrInvalidConn or
//     driver.ErrBadConn instead, classified by origin): 2002, 2003, 2006
//     CR_SERVER_GONE_ERROR, 2013 CR_SERVER_LOST, 2055 CR_SERVER_LOST_EXTENDED.
//   - ClassConfiguration: 1146 table does not exist, 1054 unknown column,
//     1142/1143 table/column access denied, 1044/1045 access denied, 1049
//     unknown database;
//   - ClassOrdinary: everything else, and errors that are not MySQL
//     errors. Deliberately ordinary: 1153 ER_NET_PACKET_TOO_LARGE (the
//     message's own size exceeds max_allowed_packet: every retry fails
//     alike, so it is poisoned once), 3020 (invalid argument for
//     logarithm), 2005 unknown host (a connect-time code).
func Classify(err error) middleware.Class {
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return middleware.ClassOrdinary
	}
	switch me.Number {
	case 1205, 1213, 1614, 1637, 1180, 1181,
		1040, 1203, 1135, 1152, 1154, 1155, 1156, 1157, 1158, 1159, 1160, 1161, 1184, 1927, 4031,
		1053, 1077, 1079, 1080,
		1317, 1969, 3024,
		1290, 1792, 1836,
		1021, 1114, 1037, 1038, 1041, 1206, 3019,
		2002, 2003, 2006, 2013, 2055:
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
