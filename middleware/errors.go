package middleware

import "github.com/watermill-idempotency/idempotency/internal/inbox"

// Error classes decide what the consumer does with a failed attempt:
//
//   - permanent (Permanent, a malformed message, an expired event, a reused
//     event_id): never retried; published to the poison topic once, then acked;
//   - ordinary (any other handler error): retried in process
//     (RetryConfig.MaxRetries), then poisoned;
//   - transient (Transient, or an infrastructure error of the attempt's own
//     connection: SQLSTATE classes 08, 53, 57P01, 40001, 40P01, 25006, 55P03,
//     MySQL 1290/1792) and configuration errors (a missing table, a missing
//     privilege): held, retried in place with backoff, never poisoned and
//     never acked, whatever the outage's length.
//
// Errors are classified by where they come from and by code (SQLSTATE,
// MySQL error number), never by message text.

// Permanent marks err as permanent: the message is poisoned at once and
// never retried. Nil stays nil.
func Permanent(err error) error { return inbox.Permanent(err) }

// Transient marks err as transient: the delivery is held and retried in
// place, never poisoned. Nil stays nil.
func Transient(err error) error { return inbox.Transient(err) }

// IsPermanent reports whether err is permanent (see Permanent).
func IsPermanent(err error) bool { return inbox.IsPermanent(err) }

// IsTransient reports whether err is transient: marked with Transient, or
// an infrastructure error of the attempt's own connection.
func IsTransient(err error) bool { return inbox.IsTransient(err) }

// IsConfiguration reports whether err is a configuration error (a missing
// table or column, a missing privilege): held like a transient error and
// logged at ERROR with what to fix.
func IsConfiguration(err error) bool { return inbox.IsConfiguration(err) }

// ErrorClassifier classifies database errors of a driver the library does
// not link (ConsumerConfig.Classifier).
type ErrorClassifier = inbox.ErrorClassifier

// Class is an error class (ErrorClassifier's result).
type Class = inbox.Class

// The error classes.
const (
	ClassOrdinary      = inbox.ClassOrdinary
	ClassPermanent     = inbox.ClassPermanent
	ClassTransient     = inbox.ClassTransient
	ClassConfiguration = inbox.ClassConfiguration
)

// Sentinels the consumer's errors wrap; test them with errors.Is.
var (
	// ErrMalformed: the marshaler flagged the delivery malformed (not an
	// envelope); permanent, the raw body travels to the poison topic.
	ErrMalformed = inbox.ErrMalformed
	// ErrInvalidEventID: msg.UUID is not a canonical, non-nil UUID; permanent.
	ErrInvalidEventID = inbox.ErrInvalidEventID
	// ErrExpired: the event is older than the table's replay horizon, so its
	// record may be purged already; permanent.
	ErrExpired = inbox.ErrExpired
	// ErrCrashLoop: attempts of the message kept killing the process
	// (ConsumerConfig.MaxCrashes); permanent, the message is dead-lettered.
	ErrCrashLoop = inbox.ErrCrashLoop
	// ErrFuture: the event is dated beyond the allowed clock skew; permanent.
	ErrFuture = inbox.ErrFuture
	// ErrEventIDReused: an event_id already applied arrived with another
	// event name or payload; permanent, never acked unseen.
	ErrEventIDReused = inbox.ErrEventIDReused
	// ErrInFlight: another transaction holds the claim longer than
	// ConsumerConfig.LockTimeout; transient.
	ErrInFlight = inbox.ErrInFlight
	// ErrCommit: the commit did not commit (pgx's ErrTxCommitRollback, a
	// broken connection); the attempt failed.
	ErrCommit = inbox.ErrCommit
	// ErrTxAborted: the handler swallowed a failed statement, leaving the
	// transaction aborted (SQLSTATE 25P02); the attempt failed.
	ErrTxAborted = inbox.ErrTxAborted
	// ErrInvalidProduced: a message the handler produced is not a valid
	// envelope; the attempt failed.
	ErrInvalidProduced = inbox.ErrInvalidProduced
)
