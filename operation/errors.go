package operation

import (
	"errors"
	"fmt"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Sentinels callers branch on with errors.Is. Every error Runner.Do returns
// for a reason of its own matches one of them, and carries a class the
// middleware chain reads (a Permanent() bool or Transient() bool method; see
// middleware.IsPermanent and middleware.IsTransient).
var (
	// ErrConflict: the key is already recorded with another parameter
	// fingerprint. Permanent; the provider was not called. See ConflictError.
	ErrConflict = errors.New("operation: key reused with other parameters")

	// ErrInProgress: another live worker holds the key and did not finish
	// within the wait (Config.Wait, WithWait). Transient: retry later with
	// the same key. See InProgressError.
	ErrInProgress = errors.New("operation: in progress elsewhere")

	// ErrUncertain: an attempt may or may not have taken effect at the
	// provider (a timeout, an unclassified error, a crash during the call),
	// and no reconcile function settled it. See UncertainError for its class.
	ErrUncertain = errors.New("operation: outcome uncertain")

	// ErrFailed: the provider definitively rejected the operation, now or in
	// an earlier attempt whose rejection is recorded. Permanent. See
	// FailedError.
	ErrFailed = errors.New("operation: rejected")

	// ErrNotFound is what a ReconcileFunc returns (or wraps) when the
	// provider has no trace of the key: the operation never took effect, so
	// Do calls the provider, with the same key.
	ErrNotFound = errors.New("operation: not found at the provider")

	// ErrNoRecord: Get or Resolve found no record for the key.
	ErrNoRecord = errors.New("operation: no record for key")

	// ErrFinal: Resolve was asked to change a record that is already
	// succeeded or failed; those states are final.
	ErrFinal = errors.New("operation: record already final")

	// ErrLostOwnership: the attempt learned the outcome of its call but could
	// not record it because another attempt took the key over (possible only
	// after this attempt's database session ended during the call, see the
	// package doc). Transient: the next attempt finds what the new owner
	// recorded or reconciles.
	ErrLostOwnership = errors.New("operation: ownership of the key lost")

	// ErrNotRecorded: the call's outcome could not be written (the database
	// failed twice). Transient: the record stays started with this attempt
	// as owner, so the next attempt treats it as uncertain and reconciles;
	// it never calls blindly.
	ErrNotRecorded = errors.New("operation: outcome not recorded")

	// ErrSharedSQLiteFile (= sqldb.ErrSharedSQLiteFile): on SQLite, the
	// runner's database file is the one the idempotent middleware's
	// transactions write to. NewRunner refuses such a Config.DB when a
	// middleware on that file was built in this process (and
	// middleware.NewConsumer refuses the middleware when the runner came
	// first); Do refuses a call inside a transaction on its own file
	// (permanent, the provider not called) for the wirings the constructors
	// cannot see. Give the Runner a database file of its own (Config.DB).
	ErrSharedSQLiteFile = sqldb.ErrSharedSQLiteFile
)

// ConflictError is returned by Runner.Do when key is recorded with a
// fingerprint other than the one of the parameters given: the key was reused
// for a different request. It is permanent (the message goes to the poison
// topic once) and is returned before any call, whatever the record's state.
type ConflictError struct {
	// Key is the operation key.
	Key string
	// Fingerprint is the fingerprint of the parameters of this call.
	Fingerprint string
	// StoredFingerprint is the fingerprint recorded with the key.
	StoredFingerprint string
	// State is the recorded state ("" when the record was seen before the
	// key's lock was taken and its state was not read).
	State State
}

// Error names the key and the two fingerprints (abbreviated).
func (e *ConflictError) Error() string {
	return fmt.Sprintf("operation %s: key reused with other parameters (fingerprint %.12s…, recorded %.12s…)",
		e.Key, e.Fingerprint, e.StoredFingerprint)
}

// Is reports whether target is ErrConflict.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// Permanent reports true: no retry can make the parameters match.
func (e *ConflictError) Permanent() bool { return true }

// InProgressError is returned by Runner.Do when another live worker holds the
// key and the wait ended first. It is transient.
type InProgressError struct {
	// Key is the operation key.
	Key string
	// Err describes the timeout when the call waited: PostgreSQL's answer
	// (SQLSTATE 55P03), GET_LOCK's refusal (MySQL) or the process lock's
	// (SQLite); nil when the call did not wait.
	Err error
}

// Error names the key.
func (e *InProgressError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("operation %s: in progress elsewhere: %v", e.Key, e.Err)
	}
	return fmt.Sprintf("operation %s: in progress elsewhere", e.Key)
}

// Is reports whether target is ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// Unwrap returns Err.
func (e *InProgressError) Unwrap() error { return e.Err }

// Transient reports true: the holder finishes or dies, then a retry proceeds.
func (e *InProgressError) Transient() bool { return true }

// UncertainError is returned by Runner.Do when the outcome at the provider is
// unknown. The record is in state uncertain, with Key and, if one was ever
// learned, Reference. The provider is never called again on a guess.
//
// Its class depends on Retry. Retry is true when Do was given a reconcile
// function and that function may settle the question later: the error is
// then transient and a later attempt reconciles. Otherwise the error is
// permanent: no retry can settle it, so the message belongs on the
// reconciliation topic (RouteUncertain, NeedsReconciliation), for a person or
// a process to look the key up at the provider and call Runner.Resolve.
//
// The cause is kept in Cause, not in the Unwrap chain, so that a timeout
// cause (context.DeadlineExceeded, a net.Error) cannot make a
// classification helper see the error as a plain transient failure.
type UncertainError struct {
	// Key is the operation key.
	Key string
	// Kind is the key's kind.
	Kind string
	// Reference is the provider's reference for the operation, if one was
	// recorded or returned with the error; often "".
	Reference string
	// Attempts is the number of attempts that took the key, this one included.
	Attempts int
	// Retry reports whether a later attempt may settle it (see above).
	Retry bool
	// Cause is the error that made the outcome uncertain: the call's or the
	// reconcile function's error, or nil for a record found uncertain.
	Cause error
}

// Error names the key, the reference if any, the cause, and whether the
// operation needs reconciliation.
func (e *UncertainError) Error() string {
	s := "operation " + e.Key + ": outcome uncertain"
	if e.Reference != "" {
		s += " (reference " + e.Reference + ")"
	}
	if e.Cause != nil {
		s += ": " + e.Cause.Error()
	}
	if !e.Retry {
		s += "; needs reconciliation"
	}
	return s
}

// Is reports whether target is ErrUncertain.
func (e *UncertainError) Is(target error) bool { return target == ErrUncertain }

// Permanent reports !Retry.
func (e *UncertainError) Permanent() bool { return !e.Retry }

// Transient reports Retry.
func (e *UncertainError) Transient() bool { return e.Retry }

// FailedError is returned by Runner.Do when the provider definitively
// rejected the operation: in this attempt (the call or reconcile function
// returned an error wrapped with Rejected) or in an earlier one, whose
// rejection is recorded (state failed). Permanent.
type FailedError struct {
	// Key is the operation key.
	Key string
	// Reason is the rejection's text as recorded.
	Reason string
	// Cause is the rejection returned in this attempt; nil when the
	// rejection was read from the record. Kept out of the Unwrap chain for
	// the reason given on UncertainError.
	Cause error
}

// Error names the key and the rejection.
func (e *FailedError) Error() string {
	return "operation " + e.Key + ": rejected: " + e.Reason
}

// Is reports whether target is ErrFailed.
func (e *FailedError) Is(target error) bool { return target == ErrFailed }

// Permanent reports true.
func (e *FailedError) Permanent() bool { return true }

// class is what a call or reconcile function says about its error.
type class int

const (
	classUnknown   class = iota // neither wrapper: uncertain
	classRejected               // Rejected: definite failure, nothing happened
	classTransient              // Transient: nothing happened, retry same key
	classTimeout                // Timeout: may have happened
)

// classified is the wrapper Rejected, Transient and Timeout return.
type classified struct {
	class class
	err   error
}

func (e *classified) Error() string { return e.err.Error() }
func (e *classified) Unwrap() error { return e.err }

// Permanent reports true for Rejected.
func (e *classified) Permanent() bool { return e.class == classRejected }

// Transient reports true for Transient.
func (e *classified) Transient() bool { return e.class == classTransient }

func wrapClass(c class, err error) error {
	if err == nil {
		return nil
	}
	return &classified{class: c, err: err}
}

// Rejected marks an error returned by a CallFunc or ReconcileFunc as a
// definite rejection: the provider refused the request and did nothing (card
// declined, invalid account, the provider's own idempotency-key mismatch).
// Do records the key as failed, with err's text, and returns a FailedError;
// later calls with the key return that FailedError too, without calling.
// A nil err stays nil.
func Rejected(err error) error { return wrapClass(classRejected, err) }

// Transient marks an error returned by a CallFunc or ReconcileFunc as one
// after which calling again with the same key is safe: the request certainly
// had no effect (connection refused, HTTP 503 or 429 before processing), or
// the provider deduplicates requests by key for long enough. From a
// CallFunc: Do releases the key (state started, no owner) and returns a
// transient error, so the retry calls again. From a ReconcileFunc: the record
// stays uncertain and Do returns an UncertainError with Retry set.
// A nil err stays nil.
func Transient(err error) error { return wrapClass(classTransient, err) }

// Timeout marks an error after which the operation may or may not have taken
// effect (a timeout after the request was sent, a connection lost while
// waiting for the answer). Do records the key as uncertain and returns an
// UncertainError. An error a CallFunc returns without any of the three
// wrappers is treated the same way: uncertain unless said otherwise.
// A nil err stays nil.
func Timeout(err error) error { return wrapClass(classTimeout, err) }

func classOf(err error) class {
	var c *classified
	if errors.As(err, &c) {
		return c.class
	}
	return classUnknown
}

// transientError is a transient failure of this package's own (lost
// ownership, an unrecorded outcome, a routing failure, a cancelled attempt).
type transientError struct{ err error }

func (e *transientError) Error() string   { return e.err.Error() }
func (e *transientError) Unwrap() error   { return e.err }
func (e *transientError) Transient() bool { return true }

// invalidError is a caller mistake (zero key, nil call, bad parameters):
// permanent, since the same message makes the same mistake again.
type invalidError struct{ err error }

func (e *invalidError) Error() string   { return e.err.Error() }
func (e *invalidError) Unwrap() error   { return e.err }
func (e *invalidError) Permanent() bool { return true }

// NeedsReconciliation reports whether err (or an error in its chain) is an
// UncertainError that no retry can settle: the filter RouteUncertain uses,
// usable with Watermill's PoisonQueueWithFilter too.
func NeedsReconciliation(err error) bool {
	var u *UncertainError
	return errors.As(err, &u) && !u.Retry
}
