package versioned

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Metadata keys of the latest-per-family filter. The producer sets them
// (SetFamily, SetFamilySeq) before publishing; they travel as AMQP headers and
// through the outbox like any other metadata.
const (
	// MetadataFamilyKind names the kind of work a message asks for, for
	// example "catalogue.product" or "product.reindex". Messages of one kind
	// about one resource compete: only the latest matters.
	MetadataFamilyKind = "family_kind"

	// MetadataFamilyID identifies the resource, for example the SKU "p-123".
	// It is set together with MetadataFamilyKind; one without the other is an
	// invalid family (ErrFamilyInvalid).
	MetadataFamilyID = "family_id"

	// MetadataFamilySeq, optional, is the producer's sequence number of the
	// message within its family: a decimal integer in [0, 2^63-1], typically
	// the resource's row version incremented in the transaction that
	// publishes. When present it orders the family (see Position).
	MetadataFamilySeq = "family_seq"
)

// MaxFamilyPartLen bounds Family.Kind and Family.ID, in bytes: both are
// primary-key columns of the family store (VARBINARY(255) on MySQL) and
// parts of a Redis key.
const MaxFamilyPartLen = 255

// Family is a set of messages of which only the latest matters: one kind of
// work (Kind) about one resource (ID). Both are non-empty valid UTF-8 of at
// most MaxFamilyPartLen bytes without NUL bytes; they are compared exactly
// (case-sensitive, no normalisation).
type Family struct {
	Kind string
	ID   string
}

// String returns "kind/id", for logs.
func (f Family) String() string { return f.Kind + "/" + f.ID }

// Validate reports why f cannot be used (an error wrapping ErrFamilyInvalid),
// or nil.
func (f Family) Validate() error {
	for _, p := range [...]struct{ name, v string }{{MetadataFamilyKind, f.Kind}, {MetadataFamilyID, f.ID}} {
		switch {
		case p.v == "":
			return fmt.Errorf("%w: %s is empty", ErrFamilyInvalid, p.name)
		case len(p.v) > MaxFamilyPartLen:
			return fmt.Errorf("%w: %s is %d bytes, over %d", ErrFamilyInvalid, p.name, len(p.v), MaxFamilyPartLen)
		case !utf8.ValidString(p.v):
			return fmt.Errorf("%w: %s is not valid UTF-8", ErrFamilyInvalid, p.name)
		case bytes.IndexByte([]byte(p.v), 0) >= 0:
			return fmt.Errorf("%w: %s contains a NUL byte", ErrFamilyInvalid, p.name)
		}
	}
	return nil
}

// familyError is the type of ErrFamilyInvalid: permanent, because a retry of
// the same message cannot repair its metadata.
type familyError struct{ msg string }

func (e *familyError) Error() string { return e.msg }

// Permanent reports true: the error comes from the message itself.
func (e *familyError) Permanent() bool { return true }

var (
	// ErrFamilyInvalid is returned (wrapped) for a message whose family
	// metadata is present but unusable: only one of MetadataFamilyKind and
	// MetadataFamilyID, an empty, oversized, non-UTF-8 or NUL-carrying part,
	// a MetadataFamilySeq that is not a decimal integer in [0, 2^63-1], an
	// event id (msg.UUID) that is not a non-nil UUID, or neither a sequence
	// number nor a valid occurred_at to order it by. It is permanent (it has
	// a Permanent() bool method returning true): the idempotency middleware
	// routes the message to the poison topic instead of retrying it, and
	// LatestPublisher refuses to publish it.
	ErrFamilyInvalid error = &familyError{"versioned: invalid family metadata"}

	// ErrNoTransaction is returned (wrapped) by the LatestFilter when the
	// message's context holds no transaction (middleware.TxFromContext):
	// the filter is not inside the idempotent middleware. It is a
	// configuration error, permanent like ErrFamilyInvalid.
	ErrNoTransaction error = &familyError{"versioned: LatestFilter outside the idempotent middleware (no transaction in the message context)"}

	// ErrNoConsumer is returned by the LatestFilter for a message with a
	// family when neither LatestFilterConfig.Consumer nor a Watermill handler
	// name in the message context names the consumer. Permanent.
	ErrNoConsumer error = &familyError{"versioned: LatestFilter: no consumer name (set LatestFilterConfig.Consumer or run under a Watermill router)"}
)

// SetFamily sets msg's family metadata (MetadataFamilyKind, MetadataFamilyID)
// and removes any MetadataFamilySeq: the family is then ordered by
// (occurred_at, event_id). It returns an error wrapping ErrFamilyInvalid, and
// changes nothing, when f is invalid.
func SetFamily(msg *message.Message, f Family) error {
	if err := f.Validate(); err != nil {
		return err
	}
	msg.Metadata.Set(MetadataFamilyKind, f.Kind)
	msg.Metadata.Set(MetadataFamilyID, f.ID)
	delete(msg.Metadata, MetadataFamilySeq)
	return nil
}

// SetFamilySeq is SetFamily plus the producer's sequence number seq (≥ 0),
// which then orders the family. It returns an error wrapping
// ErrFamilyInvalid, and changes nothing, for an invalid f or a negative seq.
func SetFamilySeq(msg *message.Message, f Family, seq int64) error {
	if seq < 0 {
		return fmt.Errorf("%w: %s %d is negative", ErrFamilyInvalid, MetadataFamilySeq, seq)
	}
	if err := SetFamily(msg, f); err != nil {
		return err
	}
	msg.Metadata.Set(MetadataFamilySeq, strconv.FormatInt(seq, 10))
	return nil
}

// FamilyOf reads msg's family and its position in the family. ok is false,
// with a nil error, when msg carries neither MetadataFamilyKind nor
// MetadataFamilyID: such a message belongs to no family and the filter lets
// it through untouched. err wraps ErrFamilyInvalid when the metadata is
// present but unusable (see ErrFamilyInvalid).
//
// The position is (MetadataFamilySeq, event_id) when the sequence number is
// present, else (occurred_at parsed at full precision by
// marshaler.OccurredAt, event_id). msg.UUID is parsed with
// marshaler.ParseEventID, so any RFC 9562 text form is accepted.
func FamilyOf(msg *message.Message) (f Family, pos Position, ok bool, err error) {
	if msg == nil {
		return Family{}, Position{}, false, nil
	}
	kind, hasKind := msg.Metadata[MetadataFamilyKind]
	id, hasID := msg.Metadata[MetadataFamilyID]
	if !hasKind && !hasID {
		return Family{}, Position{}, false, nil
	}
	f = Family{Kind: kind, ID: id}
	if err := f.Validate(); err != nil {
		return f, Position{}, false, err
	}
	eventID, perr := marshaler.ParseEventID(msg.UUID)
	if perr != nil {
		return f, Position{}, false, fmt.Errorf("%w: event id %q: %v", ErrFamilyInvalid, msg.UUID, perr)
	}
	if s, has := msg.Metadata[MetadataFamilySeq]; has {
		seq, serr := strconv.ParseInt(s, 10, 64)
		if serr != nil || seq < 0 {
			return f, Position{}, false, fmt.Errorf("%w: %s %q is not a decimal integer in [0, 2^63-1]", ErrFamilyInvalid, MetadataFamilySeq, s)
		}
		return f, SeqPosition(seq, eventID), true, nil
	}
	at, aerr := marshaler.OccurredAt(msg)
	if aerr != nil {
		return f, Position{}, false, fmt.Errorf("%w: no %s and %v", ErrFamilyInvalid, MetadataFamilySeq, aerr)
	}
	return f, TimePosition(at, eventID), true, nil
}

// Position is a message's place in the total order of its family. Build one
// with SeqPosition or TimePosition (or read it with FamilyOf). The zero value
// is the unnumbered position at the zero time.Time with the nil UUID.
//
// The order, from older to newer:
//
//   - A position with a sequence number (HasSeq) is newer than any position
//     without one, so a producer can start sending sequence numbers at any
//     time (the first numbered message supersedes the timestamped ones). A
//     producer must not stop sending them: its later, unnumbered messages
//     would be older than every numbered one.
//   - Two numbered positions compare by Seq, then by EventID.
//   - Two unnumbered positions compare by At as an instant (offsets and
//     textual forms do not matter, nanoseconds count: "10:00:02Z" and
//     "10:00:02.000+00:00" are the same instant), then by EventID.
//   - EventIDs compare as 16 bytes, big-endian (UUID byte order): for
//     UUIDv7 ids that is their generation order within a millisecond's
//     random bits, and in any case a stable tie-break.
//
// Two messages with the same event id and the same position are the same
// message (a redelivery): neither is newer.
type Position struct {
	// HasSeq reports whether Seq is set (the producer sent MetadataFamilySeq).
	HasSeq bool
	// Seq is the producer's sequence number; meaningful only when HasSeq.
	Seq int64
	// At is the message's occurred_at; meaningful only when !HasSeq.
	At time.Time
	// EventID is the message's event id, the tie-break.
	EventID uuid.UUID
}

// SeqPosition is the position of a message with sequence number seq (≥ 0; a
// negative seq orders like 0) and event id id.
func SeqPosition(seq int64, id uuid.UUID) Position {
	if seq < 0 {
		seq = 0
	}
	return Position{HasSeq: true, Seq: seq, EventID: id}
}

// TimePosition is the position of a message without a sequence number that
// occurred at at, with event id id.
func TimePosition(at time.Time, id uuid.UUID) Position {
	return Position{At: at, EventID: id}
}

// Compare returns -1 when p is older than o, +1 when newer, 0 when equal.
// It is a total order; bytes.Compare on MarshalBinary gives the same result.
func (p Position) Compare(o Position) int {
	return bytes.Compare(p.key(), o.key())
}

// After reports whether p is strictly newer than o.
func (p Position) After(o Position) bool { return p.Compare(o) > 0 }

// String is a short description for logs: "seq=42 id=…" or
// "at=2024-07-01T10:00:02.5Z id=…".
func (p Position) String() string {
	if p.HasSeq {
		return fmt.Sprintf("seq=%d id=%s", p.Seq, p.EventID)
	}
	return fmt.Sprintf("at=%s id=%s", p.At.UTC().Format(time.RFC3339Nano), p.EventID)
}

// Encoded key layout (see MarshalBinary). The first byte separates the two
// modes and makes a numbered position newer than any unnumbered one; within
// a mode the length is fixed, so bytewise comparison is lexicographic
// comparison of the fields.
const (
	keyModeTime = 0x00
	keyModeSeq  = 0x01
	keyLenSeq   = 1 + 8 + 16     // mode, seq (big-endian), event id
	keyLenTime  = 1 + 8 + 4 + 16 // mode, unix seconds (offset binary), nanoseconds, event id
)

// key is the order-preserving encoding (MarshalBinary without the error).
func (p Position) key() []byte {
	if p.HasSeq {
		b := make([]byte, keyLenSeq)
		b[0] = keyModeSeq
		seq := p.Seq
		if seq < 0 {
			seq = 0
		}
		binary.BigEndian.PutUint64(b[1:9], uint64(seq))
		copy(b[9:], p.EventID[:])
		return b
	}
	b := make([]byte, keyLenTime)
	b[0] = keyModeTime
	// Offset binary: flipping the sign bit makes the unsigned big-endian
	// order of the seconds their signed order (instants before 1970 too).
	binary.BigEndian.PutUint64(b[1:9], uint64(p.At.Unix())^(1<<63))
	binary.BigEndian.PutUint32(b[9:13], uint32(p.At.Nanosecond()))
	copy(b[13:], p.EventID[:])
	return b
}

// MarshalBinary encodes p in 25 bytes (numbered) or 29 bytes (timestamped)
// such that bytes.Compare of two encodings equals Compare of the positions.
// The stores keep and compare this form: PostgreSQL as bytea, MySQL as
// VARBINARY, SQLite as a BLOB (each compared bytewise), Redis as lower-case hex (compared byte by byte in the Lua
// script). The time is kept to the nanosecond (PostgreSQL's timestamptz
// would round to microseconds). It never returns an error.
func (p Position) MarshalBinary() ([]byte, error) { return p.key(), nil }

// UnmarshalBinary decodes what MarshalBinary produced. The time is restored
// in UTC.
func (p *Position) UnmarshalBinary(b []byte) error {
	switch {
	case len(b) == keyLenSeq && b[0] == keyModeSeq:
		seq := binary.BigEndian.Uint64(b[1:9])
		if seq > 1<<63-1 {
			return errors.New("versioned: position: sequence number out of range")
		}
		*p = Position{HasSeq: true, Seq: int64(seq)}
		copy(p.EventID[:], b[9:])
	case len(b) == keyLenTime && b[0] == keyModeTime:
		sec := int64(binary.BigEndian.Uint64(b[1:9]) ^ (1 << 63))
		nsec := binary.BigEndian.Uint32(b[9:13])
		if nsec >= 1e9 {
			return errors.New("versioned: position: nanoseconds out of range")
		}
		*p = Position{At: time.Unix(sec, int64(nsec)).UTC()}
		copy(p.EventID[:], b[13:])
	default:
		return fmt.Errorf("versioned: position: %d bytes with mode %#x is no encoded position", len(b), firstByte(b))
	}
	return nil
}

func firstByte(b []byte) int {
	if len(b) == 0 {
		return -1
	}
	return int(b[0])
}
