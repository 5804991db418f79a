package inbox

import (
	"errors"
	"fmt"
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
	// lock_not_available). Transient:
	// retry later, never poison.
	ErrInFlight = errors.New("idempotency: event in flight elsewhere")

	// ErrNoConsumer: Config.Consumer is empty or blank (NewIdempotent refuses
	// it, wrapping this sentinel).
	ErrNoConsumer = errors.New("idempotency: no consumer name (set Config.Consumer)")

	// ErrSharedConsumer: one idempotent middleware (one Config.Consumer)
	// serves several router handlers; logged at ERROR once per new handler
	// (see Idempotent.Middleware), never returned by an attempt.
	ErrSharedConsumer = errors.New("idempotency: one consumer name serves several handlers (a fan-out needs one Consumer per handler)")

	// ErrExpired: the event is older than Config.ReplayHorizon; its processed
	// record may have been purged, so it is refused. Permanent.
	ErrExpired = errors.New("idempotency: event older than the replay horizon")
	// ErrCrashLoop: attempts of the message keep killing the process
	// (Config.MaxCrashes); permanent, so the message is dead-lettered and the
	// ones behind it are applied.
	ErrCrashLoop = errors.New("idempotency: message kills the process (crash loop)")

	// ErrCommit: COMMIT did not commit (pgx.ErrTxCommitRollback: the server
	// answered ROLLBACK because a statement failed inside the transaction, or
	// the connection broke). The effects and the claim are gone; the message
	// must be retried, never acked.
	ErrCommit = errors.New("idempotency: commit failed")

	// ErrConfiguration: the attempt failed because the deployment is wrong,
	// not the message: a missing table or column (the processed table when
	// processed.Migrate was not run), a missing privilege, an unknown schema
	// or database (see ConfigurationError). The chain never poisons it: the
	// delivery is held on the broker and an ERROR log says what to fix.
	ErrConfiguration = errors.New("idempotency: configuration error")

	// ErrInfrastructure: the attempt's infrastructure failed (see
	// InfrastructureError): the middleware's own begin, claim, commit or
	// rollback, or the attempt's connection. Transient.
	ErrInfrastructure = errors.New("idempotency: infrastructure failure")
)

// Class is what the chain does with an error (ClassOf).
type Class int

// The error classes, see ClassOf.
const (
	// ClassOrdinary: a handler's own error (a bug, a 500 from a dependency,
	// a bad payload): retried ChainConfig.MaxRetries times in-process, then
	// poisoned. Also what an ErrorClassifier returns for errors it has no
	// opinion about.
	ClassOrdinary Class = iota
	// ClassPermanent: no retry can fix it; poisoned at once.
	ClassPermanent
	// ClassTransient: the attempt's infrastructure failed; the delivery is
	// held and retried in place, never poisoned.
	ClassTransient
	// ClassConfiguration: the deployment is wrong; held like ClassTransient,
	// logged at ERROR with what to fix, never poisoned.
	ClassConfiguration
)

// String is the class's name: "ordinary", "permanent", "transient",
// "configuration".
func (c Class) String() string {
	switch c {
	case ClassPermanent:
		return "permanent"
	case ClassTransient:
		return "transient"
	case ClassConfiguration:
		return "configuration"
	}
	return "ordinary"
}

// ErrorClassifier classifies errors of a database driver by their code, for
// drivers the middleware does not link (Config.Classifier): mysqlerr.Classify
// for go-sql-driver/mysql (MySQL, MariaDB). It returns ClassOrdinary for an
// error it has no opinion about. PostgreSQL errors (any error with a
// SQLState() string method, as *pgconn.PgError) are classified without one.
type ErrorClassifier func(err error) Class

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
// is held and retried with backoff and never sent to the poison topic for this
// reason. A handler wraps its own errors with Transient when it knows they are
// (a dependency that said "try later").
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

// InfrastructureError is an error of the attempt's infrastructure, by origin:
// the middleware's own begin, claim, commit or rollback failed, or the
// handler failed and the attempt's connection was found broken (its
// rollback failed). It is transient whatever Err looks like, and matches
// ErrInfrastructure.
type InfrastructureError struct {
	// Op is what failed: "begin and claim", "commit", "rollback",
	// "poison publish".
	Op  string
	Err error
}

// Error is "idempotency: <op>: <err>".
func (e *InfrastructureError) Error() string { return "idempotency: " + e.Op + ": " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *InfrastructureError) Unwrap() error { return e.Err }

// Is reports whether target is ErrInfrastructure.
func (e *InfrastructureError) Is(target error) bool { return target == ErrInfrastructure }

// Transient reports true: see IsTransient.
func (e *InfrastructureError) Transient() bool { return true }

// ConfigurationError is a configuration error (ErrConfiguration): Hint says
// what to fix. The chain holds the delivery and logs the hint at ERROR; it
// never poisons it.
type ConfigurationError struct {
	// Hint is what to fix, for the log.
	Hint string
	Err  error
}

// Error is the wrapped error's text followed by the hint.
func (e *ConfigurationError) Error() string {
	return "idempotency: configuration: " + e.Err.Error() + " (" + e.Hint + ")"
}

// Unwrap returns the wrapped error.
func (e *ConfigurationError) Unwrap() error { return e.Err }

// Is reports whether target is ErrConfiguration.
func (e *ConfigurationError) Is(target error) bool { return target == ErrConfiguration }

// Configuration reports true: see IsConfiguration.
func (e *ConfigurationError) Configuration() bool { return true }

// ClassOf is the class of err, decided by type and origin, never by message
// text or by shape alone:
//
//   - ClassPermanent: an error in the chain has Permanent() bool true
//     (PermanentError, …). Permanent wins over everything it wraps.
//   - ClassConfiguration: Configuration() bool true (ConfigurationError), or
//     a typed SQLSTATE (an error with SQLState() string, as *pgconn.PgError)
//     of a configuration error: 42P01 undefined table, 42703 undefined
//     column, 42883 undefined function, 42501 insufficient privilege,
//     3F000 invalid schema, 3D000 invalid database, 28000/28P01 invalid
//     authorization.
//   - ClassTransient: Transient() bool true (TransientError,
//     InfrastructureError, operation's transient errors), ErrInFlight, or a
//     typed SQLSTATE of a connection or server-state failure, decided by
//     class: 08 (connection exception), 53 (insufficient resources), 57
//     (operator intervention, 57014 query canceled included), 58 (system
//     error), 72 (snapshot too old), F0 (configuration file), XX (internal
//     error, data or index corrupted); and in mixed classes 25006
//     (read-only transaction: a standby or a demoted primary), 25P03/25P04
//     (session ended by a timeout), 40001 (serialization failure), 40003
//     (statement completion unknown), 40P01 (deadlock), 55006 (object in
//     use), 55P03 (lock not available), 26000/42P05 (a prepared statement
//     the session lost or already has: DISCARD ALL, a transaction
//     pooler). See sqlStateCodeClass for the
//     source of each.
//   - ClassOrdinary: everything else, including a bare io.EOF, net.Error,
//     context.DeadlineExceeded, syscall.ECONNREFUSED or driver.ErrBadConn
//     that a handler returns: it may come from the handler's own
//     dependencies, so it is retried then poisoned unless the handler wraps
//     it with Transient. The same errors from the middleware's own calls
//     are InfrastructureErrors (transient) by origin.
//
// The idempotent middleware applies Config.Classifier to the attempt's
// errors before they leave it (MySQL codes: mysqlerr.Classify), so its
// result is visible here through the wrappers it adds. A nil err is
// ClassOrdinary.
func ClassOf(err error) Class {
	if err == nil {
		return ClassOrdinary
	}
	if IsPermanent(err) {
		return ClassPermanent
	}
	var c interface{ Configuration() bool }
	if errors.As(err, &c) && c.Configuration() {
		return ClassConfiguration
	}
	var t interface{ Transient() bool }
	if errors.As(err, &t) && t.Transient() {
		return ClassTransient
	}
	if errors.Is(err, ErrInFlight) {
		return ClassTransient
	}
	return sqlStateClass(err)
}

// IsTransient reports whether err is an infrastructure failure that retrying
// in place can cure: ClassOf(err) == ClassTransient. A permanent error is
// never transient, whatever it wraps.
func IsTransient(err error) bool { return ClassOf(err) == ClassTransient }

// IsConfiguration reports whether err is a configuration error:
// ClassOf(err) == ClassConfiguration.
func IsConfiguration(err error) bool { return ClassOf(err) == ClassConfiguration }

// sqlStateClass classifies a typed SQLSTATE in err's chain.
func sqlStateClass(err error) Class {
	var s interface{ SQLState() string }
	if !errors.As(err, &s) {
		return ClassOrdinary
	}
	return sqlStateCodeClass(s.SQLState())
}

// sqlStateCodeClass classifies a PostgreSQL SQLSTATE (PostgreSQL
// documentation, Appendix A "PostgreSQL Error Codes"; the server's
// src/backend/utils/errcodes.txt). Infrastructure is decided by CLASS (the
// first two characters) where the whole class is the server's or the
// connection's state, so that a code we did not list (a newer one, a
// rarely seen one) is never poisoned:
//
//   - class 08 connection exception (08000, 08003, 08006, 08001, 08004,
//     08007 transaction resolution unknown, 08P01 protocol violation);
//   - class 53 insufficient resources (53000, 53100 disk full, 53200 out of
//     memory, 53300 too many connections, 53400 configuration limit
//     exceeded);
//   - class 57 operator intervention (57000, 57014 query canceled:
//     statement_timeout or pg_cancel_backend, 57P01 admin shutdown: also
//     pg_terminate_backend, 57P02 crash shutdown, 57P03 cannot connect
//     now, 57P04 database dropped, 57P05 idle session timeout);
//   - class 58 system error, errors external to PostgreSQL (58000, 58030
//     I/O error, 58P01 undefined file, 58P02 duplicate file, and later
//     additions such as 58P03);
//   - class 72 snapshot failure (72000 snapshot too old);
//   - class F0 configuration file error (F0000, F0001 lock file exists);
//   - class XX internal error (XX000 internal error, XX001 data corrupted,
//     XX002 index corrupted).
//
// In mixed classes only the codes of the server's state are transient:
// 25006 read-only transaction (a standby, a demoted primary), 25P03
// idle-in-transaction session timeout, 25P04 transaction timeout (17+);
// 40001 serialization failure, 40003 statement completion unknown, 40P01
// deadlock detected (40000 and 40002, a deferred constraint, are the
// data's: ordinary); 55006 object in use, 55P03 lock not available; 26000
// invalid statement name and 42P05 duplicate prepared statement (the
// session's prepared statements changed under the client: DISCARD ALL, a
// pooler sharing server connections; a pooler's own protocol errors are
// class 08).
//
// These codes come from the server's state, not from a message: they are
// transient wherever they arise in the attempt (the claim, a handler
// statement, the commit), including a PL/pgSQL RAISE … USING ERRCODE of
// such a code (whoever raises a server-state code asks for a retry).
// Configuration (held, ERROR with a hint): 42P01, 42703, 42883, 42501,
// 3F000, 3D000, 28000, 28P01.
func sqlStateCodeClass(code string) Class {
	if len(code) != 5 {
		return ClassOrdinary
	}
	switch code[:2] {
	case "08", "53", "57", "58", "72", "F0", "XX":
		return ClassTransient
	}
	switch code {
	case "25006", "25P03", "25P04", "40001", "40003", "40P01", "55006", "55P03":
		return ClassTransient
	case "26000", "42P05":
		// A prepared statement the session does not know, or already has
		// under that name: the session changed under the client (DISCARD
		// ALL, a transaction pooler such as PgBouncer < 1.21 sharing server
		// connections between clients). pgx drops a failed statement from
		// its cache, so a later attempt prepares it again.
		return ClassTransient
	case "42P01", "42703", "42883", "42501", "3F000", "3D000", "28000", "28P01":
		return ClassConfiguration
	}
	return ClassOrdinary
}

// classify applies the driver classifier to err (when err is not classified
// yet) and wraps it so that ClassOf sees the result.
func classify(err error, cls ErrorClassifier) error {
	if err == nil {
		return err
	}
	c := ClassOf(err)
	if c == ClassOrdinary && cls != nil {
		c = cls(err)
		switch c {
		case ClassTransient:
			return Transient(err)
		case ClassPermanent:
			return permanent("driver", err)
		}
	}
	var ce *ConfigurationError
	if c == ClassConfiguration && !errors.As(err, &ce) {
		return &ConfigurationError{Hint: "the database refused a statement of the handler: create the missing table or column (run the migrations), or grant the privilege", Err: err}
	}
	return err
}

const claimHint = "the claim failed: run processed.Migrate for this store's table, check the schema/search_path and that the role may INSERT into it"

// claimError classifies an error of the middleware's own BEGIN, lock
// timeout and claim (the attempt's connection, by origin): an
// InfrastructureError stays one (a prepared statement of the pgx beginner
// that its connection lost, pgxclaim.go), a lock timeout is ErrInFlight, a configuration code, or another server error on our own
// statement, is a ConfigurationError, a cancelled statement (57014) and
// anything else an InfrastructureError (the connection or the server
// failed).
func claimError(err error, cls ErrorClassifier) error {
	var ce *ConfigurationError
	var ie *InfrastructureError
	if IsPermanent(err) || errors.As(err, &ce) || errors.As(err, &ie) {
		return err
	}
	if cls != nil && ClassOf(err) == ClassOrdinary {
		if c := cls(err); c == ClassConfiguration {
			return &ConfigurationError{Hint: claimHint, Err: err}
		}
	}
	if statementInvalid(err) {
		// Our prepared statement was lost (26000) or its plan no longer
		// fits the table (0A000): the next attempt prepares it again; it
		// is not the deployment's error.
		return &InfrastructureError{Op: "prepared statement lost or invalidated", Err: err}
	}
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		// A transient class (57014 query_canceled by statement_timeout,
		// 08, 53, 57, 58, XX, …, see sqlStateCodeClass) falls through to
		// InfrastructureError below.
		switch sqlStateCodeClass(s.SQLState()) {
		case ClassConfiguration:
			return &ConfigurationError{Hint: claimHint, Err: err}
		case ClassOrdinary:
			// A server error on a healthy connection: our statement does
			// not fit the table (created by another version, wrong types).
			return &ConfigurationError{Hint: claimHint, Err: err}
		}
		if s.SQLState() == "55P03" {
			return fmt.Errorf("%w: %w", ErrInFlight, err)
		}
	}
	// SQLite (modernc.org/sqlite) reports SQLITE_ERROR (1) for "no such
	// table" and other errors in our own statement: a configuration error
	// when it comes from the claim on the attempt's connection (origin, not
	// shape: handler errors are never classified this way).
	var lite interface{ Code() int }
	if errors.As(err, &lite) && lite.Code()&0xff == 1 {
		return &ConfigurationError{Hint: claimHint, Err: err}
	}
	return &InfrastructureError{Op: "begin and claim", Err: err}
}

// attemptError classifies the error with which an attempt failed after the
// claim (handler, outbox write): a failed rollback means the attempt's
// connection broke (InfrastructureError, transient) unless err is
// permanent; otherwise Config.Classifier may classify a driver code.
func attemptError(err, rbErr error, cls ErrorClassifier) error {
	if rbErr != nil {
		if IsPermanent(err) {
			return errors.Join(err, fmt.Errorf("idempotency: rollback: %w", rbErr))
		}
		return &InfrastructureError{Op: "rollback", Err: errors.Join(err, rbErr)}
	}
	return classify(err, cls)
}

// classifyCommitError classifies a failed COMMIT that was not an aborted
// transaction (commitError handles those): a permanent error or a typed
// code keeps its class, and any other failure is the connection's
// (InfrastructureError).
func classifyCommitError(cErr error, cls ErrorClassifier) error {
	if IsPermanent(cErr) {
		return cErr
	}
	if c := classify(cErr, cls); ClassOf(c) != ClassOrdinary {
		return c
	}
	var s interface{ SQLState() string }
	if errors.As(cErr, &s) {
		return cErr // e.g. a deferred constraint: the handler's data
	}
	return &InfrastructureError{Op: "commit", Err: cErr}
}
