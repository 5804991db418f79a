package operation

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// State is the recorded state of an operation.
type State string

const (
	// StateStarted: an attempt owns the key and may be calling the provider
	// now (or died while it could have been); or, with no owner, the last
	// call certainly had no effect and the next attempt may call.
	StateStarted State = "started"
	// StateSucceeded: the provider did it; Reference and Result are recorded.
	// Final.
	StateSucceeded State = "succeeded"
	// StateFailed: the provider definitively rejected it; Error is recorded.
	// Final.
	StateFailed State = "failed"
	// StateUncertain: the provider may or may not have done it; only a
	// lookup at the provider (a ReconcileFunc, or Resolve after a person
	// looked) moves it on.
	StateUncertain State = "uncertain"
)

// Origin says where the Result that Runner.Do returned comes from.
type Origin string

const (
	// OriginCall: this attempt called the provider and it succeeded.
	OriginCall Origin = "call"
	// OriginStored: an earlier attempt's recorded success; nothing was
	// called.
	OriginStored Origin = "stored"
	// OriginReconciled: the outcome of an earlier, uncertain attempt, found
	// by the reconcile function (or recorded by Resolve) and now recorded.
	OriginReconciled Origin = "reconciled"
)

// Result is what an operation's success leaves behind.
type Result struct {
	// Reference is the provider's identifier of the effect (a charge id, a
	// message id); "" when it has none. Stored as text, NULL when "", in a
	// form every database stores: a byte that is not UTF-8 becomes U+FFFD
	// and a NUL is dropped. Do returns it as stored, on every path.
	Reference string
	// Data is opaque bytes the handler needs when the result is replayed
	// (a provider response, a receipt); stored as is, nil when absent.
	Data []byte
	// Origin is set by Runner.Do; a CallFunc or ReconcileFunc leaves it
	// empty (its value there is ignored).
	Origin Origin
}

// Record is one row of the operations table.
type Record struct {
	// Key is the operation key's text.
	Key string
	// Kind is the key's kind.
	Kind string
	// Fingerprint is Fingerprint of the parameters the key was first used
	// with.
	Fingerprint string
	// State is the current state.
	State State
	// Reference is the provider's reference, "" if none is known.
	Reference string
	// Result is the recorded result bytes (succeeded only), nil otherwise.
	Result []byte
	// Error is the text of the last rejection, timeout or transient error,
	// "" if none; stored as Result.Reference is (valid UTF-8, no NUL).
	Error string
	// Attempts counts the attempts that took the key (called or reconciled).
	Attempts int
	// Owner is the token (a UUID) of the attempt that owns the row, "" when
	// none does.
	Owner string
	// CreatedAt and UpdatedAt are the database clock's times (now(), UTC on
	// MySQL and SQLite) of the insert and of the last change.
	CreatedAt, UpdatedAt time.Time
}

// CallFunc performs the external effect. key is the operation key's text:
// pass it to the provider as its idempotency key. Return the Result on
// success; on failure return an error wrapped with Rejected (definitely not
// done), Transient (definitely not done, or deduplicated by the provider:
// call again) or Timeout (maybe done). An unwrapped error counts as Timeout.
// ctx is the ctx given to Runner.Do.
type CallFunc func(ctx context.Context, key string) (Result, error)

// ReconcileFunc looks an uncertain operation up at the provider, by
// rec.Key (or rec.Reference). Return the Result if the provider did it; an
// error matching ErrNotFound if it has no trace of it (Do then calls, with the
// same key); Rejected(err) if it refused it; Transient(err) if the lookup
// itself failed and may work later. Any other error leaves the operation
// uncertain for a person (a permanent UncertainError). It must not perform
// the effect itself.
type ReconcileFunc func(ctx context.Context, rec Record) (Result, error)

// recordScan reads a row of the record columns from any driver: pgx hands
// the sql.Scanner fields its database/sql values (text for uuid), MySQL
// bytes for VARBINARY and BINARY(16), SQLite text for times.
type recordScan struct {
	rec       Record
	reference sql.NullString
	errText   sql.NullString
	attempts  int64
	owner     ownerScan
	created   timeScan
	updated   timeScan
}

func (s *recordScan) dest() []any {
	return []any{&s.rec.Key, &s.rec.Kind, &s.rec.Fingerprint, &s.rec.State, &s.reference,
		&s.rec.Result, &s.errText, &s.attempts, &s.owner, &s.created, &s.updated}
}

func (s *recordScan) record() Record {
	r := s.rec
	r.Reference = s.reference.String
	r.Error = s.errText.String
	r.Attempts = int(s.attempts)
	r.Owner = s.owner.text
	r.CreatedAt, r.UpdatedAt = s.created.T, s.updated.T
	return r
}

// ownerScan reads an owner token: NULL, a UUID's text (PostgreSQL) or its
// 16 bytes (MySQL BINARY(16), SQLite BLOB). text is the canonical form, ""
// for NULL.
type ownerScan struct{ text string }

func (o *ownerScan) Scan(src any) error {
	var (
		id  uuid.UUID
		err error
	)
	switch v := src.(type) {
	case nil:
		o.text = ""
		return nil
	case string:
		id, err = uuid.Parse(v)
	case []byte:
		if len(v) == 16 {
			id, err = uuid.FromBytes(v)
		} else {
			id, err = uuid.ParseBytes(v)
		}
	default:
		err = fmt.Errorf("unsupported type %T", src)
	}
	if err != nil {
		return fmt.Errorf("operation: owner: %w", err)
	}
	o.text = id.String()
	return nil
}

// timeScan is the dialect-neutral timestamp scanner of the driver seam.
type timeScan = sqldb.Time

// storableText is s as every dialect's text columns store it: valid UTF-8
// (a byte that is not becomes U+FFFD) without NUL. PostgreSQL (22021) and
// MySQL/MariaDB in strict mode (1366) refuse anything else, and a refused
// outcome write left the record started by its attempt: a charge that went
// through became uncertain, and a reconcile finding the same reference was
// refused again on every attempt.
func storableText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "")
}
