package sqldb

import "regexp"

// mysqlServerError matches go-sql-driver's *MySQLError text, "Error
// <number> (<SQLSTATE>): …": the server's answer. The core links no MySQL
// driver, and that type has no method to read its number by.
var mysqlServerError = regexp.MustCompile(`Error (\d{4,5}) \([0-9A-Z]{5}\): `)

// MySQLErrorNumber returns the server error number in err's text ("1060")
// and true when err is a MySQL or MariaDB server error as go-sql-driver
// reports it; "" and false otherwise (a connection error, another
// driver's).
func MySQLErrorNumber(err error) (string, bool) {
	if m := mysqlServerError.FindStringSubmatch(err.Error()); m != nil {
		return m[1], true
	}
	return "", false
}
