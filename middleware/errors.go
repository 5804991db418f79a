package middleware

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
)

// Sentinels callers branch on with errors.Is.
var (
	// ErrMalformed: the delivery could not be decoded into an envelope (see
	// marshaler.Malformed). Permanent.
	ErrMalformed = errors.New("idempotency: malformed message")

	// ErrInvalidEventID: msg.UUID is not an RFC 9562 UUID, or is the nil UUID.
	// Permanent.
	ErrInvalidEventID = errors.New("idempotency: invalid event_id")

	// ErrInFlight: another transaction holds the claim of this event and did
	// not finish within Config.LockTimeout (PostgreSQL 55P03
	// lock_not_available). Transient: retry later, never poison.
	ErrInFlight = errors.New("idempotency: event in flight elsewhere")

	// ErrNoConsumer: Config.Consumer is empty or blank (NewIdempotent refuses
	// it, wrapping this sentinel).
	ErrNoConsumer = errors.New("idempotency: no consumer name (set Config.Consumer)")

	// ErrExpired: the event is older than Config.ReplayHorizon; its processed
	// record may have been purged, so it is refused. Permanent.
	ErrExpired = errors.New("idempotency: event older than the replay horizon")

	// ErrCommit: COMMIT did not commit (pgx.ErrTxCommitRollback: the server
	// answered ROLLBACK because a statement failed inside the transaction, or
	// the connection broke). The effects and the claim are gone; the message
	// must be retried, never acked.
	ErrCommit = errors.New("idempotency: commit failed")
)

// PermanentError marks an error that no retry can fix: the message goes to the
// poison/dead-letter topic once. Wrap with Permanent; detect with IsPermanent.
type PermanentError struct {
	// Reason is a short machine-friendly word: "malformed", "invalid_event_id",
	// "expired", "version_missing", "user", …
	Reason string
	Err    error
}

// Error is the wrapped error's text (or "permanent (<reason>)").
func (e *PermanentError) Error() string {
	if e.Err == nil {
		return "permanent (" + e.Reason + ")"
	}
	return e.Err.Error()
}

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent reports true: see IsPermanent.
func (e *PermanentError) Permanent() bool { return true }

// Permanent wraps err as permanent with reason "user". A nil err stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Reason: "user", Err: err}
}

func permanent(reason string, err error) error { return &PermanentError{Reason: reason, Err: err} }

// IsPermanent reports whether any error in err's chain has a method
// Permanent() bool returning true (PermanentError, versioned.ErrVersionMissing,
// operation conflicts, …). Such errors are never retried.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

// TransientError marks an error that a later attempt may not have: the message
// is retried with backoff and never sent to the poison topic for this reason.
type TransientError struct{ Err error }

// Error is the wrapped error's text.
func (e *TransientError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *TransientError) Unwrap() error { return e.Err }

// Transient reports true: see IsTransient.
func (e *TransientError) Transient() bool { return true }

// Transient wraps err as transient. A nil err stays nil.
func Transient(err error) error {
	if err == nil {
		return nil
	}
	return &TransientError{Err: err}
}

// IsTransient reports whether err is an infrastructure failure that retrying
// can cure: an error with Transient() bool true (TransientError, ErrInFlight),
// or, classified by type and SQLSTATE code and never by message text:
// PostgreSQL class 08 (connection exception), 57P01/57P02/57P03 (admin
// shutdown, crash shutdown, cannot connect now), 40001 (serialization
// failure), 40P01 (deadlock), 55P03 (lock timeout), 53300 (too many
// connections); a closed pgx pool (puddle.ErrClosedPool); network errors
// (net.Error, ECONNREFUSED, ECONNRESET, EPIPE, io.EOF, io.ErrUnexpectedEOF);
// MySQL/MariaDB errors 1205 (lock wait timeout), 1213 (deadlock), 1040,
// 1053, 2006, 2013; SQLite SQLITE_BUSY and SQLITE_LOCKED; driver.ErrBadConn;
// pgconn.SafeToRetry and pgconn.Timeout errors; and a context deadline.
// A cancelled context (shutdown) is transient too: the message is nacked and
// redelivered.
//
// A permanent error (IsPermanent) is never transient, whatever it wraps: a
// permanent error caused by a timeout must still go to the poison topic.
func IsTransient(err error) bool {
	if err == nil || IsPermanent(err) {
		return false
	}
	var t interface{ Transient() bool }
	if errors.As(err, &t) && t.Transient() {
		return true
	}
	if errors.Is(err, ErrInFlight) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return transientSQLState(pgErr.Code)
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		// 1205 lock wait timeout, 1213 deadlock, 1040 too many connections,
		// 1053 server shutdown, 2006/2013 server gone / lost connection.
		switch myErr.Number {
		case 1205, 1213, 1040, 1053, 2006, 2013:
			return true
		}
		return false
	}
	var liteErr interface{ Code() int }
	if errors.As(err, &liteErr) {
		// SQLite primary result codes 5 SQLITE_BUSY and 6 SQLITE_LOCKED
		// (the extended code's low byte), as modernc.org/sqlite reports them.
		switch liteErr.Code() & 0xff {
		case 5, 6:
			return true
		}
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, mysql.ErrInvalidConn) {
		return true
	}
	if errors.Is(err, puddle.ErrClosedPool) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return true
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	return false
}

func transientSQLState(code string) bool {
	if len(code) == 5 && code[:2] == "08" {
		return true
	}
	switch code {
	case "57P01", "57P02", "57P03", "40001", "40P01", "55P03", "53300", "53400":
		return true
	}
	return false
}
