package processedstore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// FingerprintVersion is the first byte of every fingerprint the store writes:
// the version of the algorithm. Version 3 is XXH64 (seed 0, big-endian)
// over the event name's length (uvarint), the name and the payload:
// another event reusing an event_id is missed with probability about
// 2⁻⁶⁴. The fingerprint decides only whether such a copy (a producer's
// bug) is reported as a conflict or acked as a duplicate, never whether an
// effect is applied: the claim's key is the event_id. It is not a defence
// against a publisher that crafts a colliding payload on purpose, which
// could as well publish anything else. Version 2 (the first 8 bytes of
// SHA-256 over the same bytes) cost 2.5k client instructions a claim
// where XXH64 costs 0.15k (issue 25). Rows of versions 1 and 2, written by
// earlier releases, are still compared, with SHA-256 computed then
// (Verdict). A stored fingerprint of a version the release does not know
// is never compared (Unverified), so a change of algorithm never turns
// stored rows into conflicts, and a release that knows only version 2
// treats rows of version 3 as plain duplicates during a rolling upgrade.
const FingerprintVersion byte = 3

// fingerprintV1 and fingerprintV2 are the versions that stored the whole
// SHA-256 (0x01 ‖ 32 bytes) and its first 8 bytes (0x02 ‖ 8 bytes),
// compared when a row written by an earlier release has them.
const (
	fingerprintV1 byte = 1
	fingerprintV2 byte = 2
)

// fingerprintSize is a version-3 (and version-2) fingerprint's length: the
// version byte and 8 bytes of the hash.
const fingerprintSize = 1 + 8

// MaxStoredEventName is how many bytes of the event name a claim stores for
// the conflict log (the fingerprint covers the whole name): longer names are
// cut at a character boundary.
const MaxStoredEventName = 255

// Identity is what a claim with payload verification records about the event
// it applied: its name (for the log of a conflict) and its fingerprint.
// Build one with NewIdentity.
type Identity struct {
	// EventName is the event's name as given (the stored copy is cut to
	// MaxStoredEventName bytes).
	EventName string
	// Fingerprint, when set, is the fingerprint as stored (a row's, of
	// any version); NewIdentity leaves it nil and keeps the hash, so an
	// identity costs no allocation (FingerprintBytes, AppendFingerprint).
	Fingerprint []byte
	// payload is the event's payload as given, for the SHA-256 of a row
	// of version 1 or 2 (Verdict); hash is its XXH64 (hashed: set by
	// NewIdentity).
	payload []byte
	hash    uint64
	hashed  bool
}

// NewIdentity fingerprints an event: its name and its payload bytes, exactly
// as received (the envelope keeps the payload byte for byte, so every copy of
// one event, whether republished by the relay or redelivered by the broker,
// has the same bytes). The name's length is hashed first, so no other split
// of the same bytes between name and payload gives the same fingerprint.
// It keeps a reference to payload and allocates nothing.
func NewIdentity(eventName string, payload []byte) Identity {
	id := Identity{EventName: eventName, payload: payload, hashed: true}
	// The usual sizes are hashed in one call over a stack buffer (160
	// instructions less than three writes to a Digest); longer ones are
	// streamed, so no size allocates.
	var stack [256]byte
	if binary.MaxVarintLen64+len(eventName)+len(payload) <= len(stack) {
		id.hash = xxhash.Sum64(appendHashed(stack[:0], eventName, payload))
		return id
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.Write(binary.AppendUvarint(stack[:0], uint64(len(eventName))))
	_, _ = d.WriteString(eventName)
	_, _ = d.Write(payload)
	id.hash = d.Sum64()
	return id
}

// sha256 is SHA-256(uvarint(len(name)) ‖ name ‖ payload), the hash of
// fingerprint versions 1 and 2.
func (id *Identity) sha256() [sha256.Size]byte {
	// One buffer hashed with Sum256: on the stack for the usual sizes.
	var stack [512]byte
	buf := stack[:0]
	if need := binary.MaxVarintLen64 + len(id.EventName) + len(id.payload); need > len(stack) {
		buf = make([]byte, 0, need)
	}
	return sha256.Sum256(appendHashed(buf, id.EventName, id.payload))
}

// appendHashed appends to dst the bytes every fingerprint version hashes:
// uvarint(len(name)) ‖ name ‖ payload.
func appendHashed(dst []byte, name string, payload []byte) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(name)))
	dst = append(dst, name...)
	return append(dst, payload...)
}

// AppendFingerprint appends id's fingerprint to dst: Fingerprint when set,
// else FingerprintVersion followed by the XXH64 of NewIdentity. ok is
// false, and dst unchanged, for an identity with neither (stored as NULL).
func (id *Identity) AppendFingerprint(dst []byte) (_ []byte, ok bool) {
	switch {
	case id.Fingerprint != nil:
		return append(dst, id.Fingerprint...), true
	case id.hashed:
		return binary.BigEndian.AppendUint64(append(dst, FingerprintVersion), id.hash), true
	}
	return dst, false
}

// FingerprintBytes is id's fingerprint (AppendFingerprint) in a slice of
// its own; nil when id has none.
func (id Identity) FingerprintBytes() []byte {
	fp, _ := id.AppendFingerprint(nil)
	return fp
}

// storedName is the event name as the claim stores it.
func (id Identity) storedName() string {
	s := id.EventName
	if len(s) <= MaxStoredEventName {
		return s
	}
	s = s[:MaxStoredEventName]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// StoredIdentity is what a processed row says about the event it recorded.
type StoredIdentity struct {
	// Found is false when no row exists (it was purged, or the duplicate's
	// claim waited on a transaction that then rolled back: impossible while
	// the caller's claim returned 0 rows in the same transaction, short of a
	// purge in between).
	Found bool
	// EventName is the stored name; "" when the row has none.
	EventName string
	// Fingerprint is the stored fingerprint; nil on rows written before the
	// fingerprint column existed, or by a claim without verification.
	Fingerprint []byte
}

// Verdict is the comparison of a duplicate with the row it collided with.
type Verdict int

const (
	// SameEvent: the fingerprints are equal; the duplicate is the event
	// that was applied.
	SameEvent Verdict = iota
	// Unverified: the row has no fingerprint of this store's version (a row
	// written before the column existed, by a claim without verification,
	// with another algorithm version, or no row at all): a plain duplicate.
	Unverified
	// OtherEvent: the fingerprints differ: the event id was reused for
	// another event (a producer bug). Nothing is applied.
	OtherEvent
)

// Verdict compares id, the identity of a message whose claim found a row,
// with that row's stored identity: a fingerprint of the current version
// with id's, one of version 2 or 1 (an earlier release's row) with 0x02 ‖
// the first 8 bytes or 0x01 ‖ the whole of SHA-256 over the same bytes.
// An identity with an explicit Fingerprint is compared only with a stored
// one of the same version.
func (id Identity) Verdict(stored StoredIdentity) Verdict {
	fp := stored.Fingerprint
	var buf [fingerprintSize]byte
	own, ok := id.AppendFingerprint(buf[:0])
	if !stored.Found || len(fp) == 0 || !ok || len(own) == 0 {
		return Unverified
	}
	var same bool
	switch {
	case fp[0] == own[0]:
		same = bytes.Equal(fp, own)
	case !id.hashed || id.Fingerprint != nil:
		return Unverified
	case fp[0] == fingerprintV2:
		sum := id.sha256()
		same = bytes.Equal(fp[1:], sum[:fingerprintSize-1])
	case fp[0] == fingerprintV1:
		sum := id.sha256()
		same = bytes.Equal(fp[1:], sum[:])
	default:
		return Unverified
	}
	if same {
		return SameEvent
	}
	return OtherEvent
}

// ClaimIdentityQuery is ClaimIdentityQueryAt with no occurred_at.
func (s *Store) ClaimIdentityQuery(consumer string, eventID uuid.UUID, id Identity) (string, []any) {
	return s.ClaimIdentityQueryAt(consumer, eventID, time.Time{}, id)
}

// ClaimIdentityQueryAt is ClaimQueryAt for a claim that also stores id
// (payload verification): the same single INSERT … ON CONFLICT DO NOTHING
// (with the replay window when Config.Horizon > 0), with the event name and
// fingerprint as two more columns; rows affected 1 for a claim and 0 for a
// duplicate or a refusal (Verdict). It needs the fingerprint migration.
func (s *Store) ClaimIdentityQueryAt(consumer string, eventID uuid.UUID, at time.Time, id Identity) (string, []any) {
	if s.dialect == sqldb.PostgreSQL {
		// The statement text is built once (NewStore); its two extra
		// placeholders come last.
		id7, t := s.sql.eventID(eventID), s.eventAtArg(eventID, at)
		if s.claimsV7(consumer, eventID) {
			return s.v7sql.claim[1], []any{s.v7ID, id7, t, id.FingerprintBytes()}
		}
		if s.routed(eventID) {
			return s.identity.claimOther, []any{consumer, id7, t, id.storedName(), id.FingerprintBytes()}
		}
		return s.identity.claim, []any{consumer, id7, t, id.storedName(), id.FingerprintBytes()}
	}
	query, args := s.ClaimQueryAt(consumer, eventID, at)
	return withIdentityColumns(query, args, id.storedName(), id.FingerprintBytes())
}

// withIdentityColumns adds the event_name and fingerprint columns to one of
// the claim statements (written once per dialect in sql_*.go, in two
// shapes: INSERT … VALUES (…) and INSERT … SELECT … [FROM DUAL] WHERE …),
// so that the claim with verification is the same single statement. The
// placeholders follow the statement's style: $n (PostgreSQL), ?n (SQLite's
// numbered form) or positional ? (MySQL, SQLite's VALUES form), whose
// arguments are inserted where the placeholders are.
func withIdentityColumns(query string, args []any, name string, fp []byte) (string, []any) {
	// The two columns close the column list (SQLite's ends with
	// processed_at), as their placeholders close the values.
	if i := strings.Index(query, "(consumer, event_id, event_at"); i >= 0 {
		end := i + strings.Index(query[i:], ")")
		query = query[:end] + ", event_name, fingerprint" + query[end:]
	}
	n := len(args)
	var ph string
	switch {
	case strings.Contains(query, "$1"):
		ph = fmt.Sprintf("$%d, $%d", n+1, n+2)
	case strings.Contains(query, "?1"):
		ph = fmt.Sprintf("?%d, ?%d", n+1, n+2)
	default:
		ph = "?, ?"
	}
	if i := strings.Index(query, "VALUES ("); i >= 0 {
		// The VALUES list ends at the parenthesis closing "VALUES (".
		depth, end := 0, -1
		for j := i + len("VALUES "); j < len(query); j++ {
			if query[j] == '(' {
				depth++
			} else if query[j] == ')' {
				depth--
				if depth == 0 {
					end = j
					break
				}
			}
		}
		query = query[:end] + ", " + ph + query[end:]
		return query, append(append(args[:n:n], name), fp)
	}
	// SELECT form: the select list is the line after the column list; its
	// placeholders come first among the arguments.
	sel := strings.Index(query, "\nSELECT ")
	eol := strings.Index(query[sel+1:], "\n") + sel + 1
	line := query[sel+1 : eol]
	if k := strings.Index(line, " FROM DUAL"); k >= 0 {
		line = line[:k] + ", " + ph + line[k:]
	} else {
		line += ", " + ph
	}
	query = query[:sel+1] + line + query[eol:]
	if ph != "?, ?" {
		return query, append(append(args[:n:n], name), fp)
	}
	inSelect := strings.Count(query[sel+1:eol], "?") - 2
	out := make([]any, 0, n+2)
	out = append(out, args[:inSelect]...)
	out = append(out, name, fp)
	return query, append(out, args[inSelect:]...)
}

// ClaimIdentity is ClaimIdentityAt with no occurred_at.
func (s *Store) ClaimIdentity(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID, id Identity) (bool, error) {
	return s.ClaimIdentityAt(ctx, q, consumer, eventID, time.Time{}, id)
}

// ClaimIdentityAt is TryClaimAt storing id with the row (see
// ClaimIdentityQueryAt). On false (a duplicate, or a refusal: Verdict),
// StoredIdentity and Identity.Verdict tell whether the row recorded the same
// event.
func (s *Store) ClaimIdentityAt(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID, at time.Time, id Identity) (bool, error) {
	if consumer == "" {
		return false, ErrEmptyConsumer
	}
	if eventID == uuid.Nil {
		return false, ErrNilEventID
	}
	query, args := s.ClaimIdentityQueryAt(consumer, eventID, at, id)
	n, err := q.Exec(ctx, query, args...)
	if err != nil {
		return false, fmt.Errorf("processed: claim %s/%s: %w", consumer, eventID, err)
	}
	return n == 1, nil
}

// StoredIdentity reads the event name and fingerprint of the row of
// (consumer, eventID), with one primary-key lookup. Run it on the
// transaction whose claim returned 0 rows: it is the duplicate path's only
// extra statement (a new event costs none).
func (s *Store) StoredIdentity(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (StoredIdentity, error) {
	var (
		name []byte
		fp   []byte
	)
	query, args := s.StoredIdentityQuery(consumer, eventID)
	err := q.QueryRow(ctx, query, args...).Scan(&name, &fp)
	if s.FoldedV7(eventID, err) {
		return s.StoredIdentity(ctx, q, consumer, eventID)
	}
	switch {
	case errors.Is(err, sqldb.ErrNoRows):
		return StoredIdentity{}, nil
	case err != nil:
		return StoredIdentity{}, fmt.Errorf("processed: read fingerprint %s/%s: %w", consumer, eventID, err)
	}
	return StoredIdentity{Found: true, EventName: string(name), Fingerprint: fp}, nil
}

// StoredIdentityQuery returns StoredIdentity's statement and arguments: one
// primary-key read of the row's event_name and fingerprint (bytea/blob;
// no row when none exists). It is exported for drivers that send it in one
// round trip with the duplicate's ROLLBACK (the middleware's pgx beginner);
// most callers want StoredIdentity. On a partitioned store, ids that are not
// UUIDv7 are read from the side table, where their claim wrote them.
func (s *Store) StoredIdentityQuery(consumer string, eventID uuid.UUID) (string, []any) {
	query := s.identity.stored
	if s.routed(eventID) && s.identity.storedOther != "" {
		query = s.identity.storedOther
	}
	if r := s.v7ReadOf(consumer, eventID); r != nil {
		query = r.stored
	}
	return query, []any{consumer, s.sql.eventID(eventID)}
}

// identityStatements are the payload-verification statements of one store,
// built once by NewStore.
type identityStatements struct {
	stored      string // the duplicate path's read of the stored identity
	storedOther string // the same on the partitioned layout's side table
	// PostgreSQL: the claims with the identity columns (built once), on the
	// table and on the partitioned layout's side table.
	claim, claimOther string
}

func newIdentityStatements(d sqldb.Dialect, q string) identityStatements {
	switch d {
	case sqldb.MySQL:
		return identityStatements{
			stored: "SELECT event_name, fingerprint FROM " + q + " WHERE consumer = ? AND event_id = ?",
		}
	case sqldb.SQLite:
		return identityStatements{
			stored: "SELECT event_name, fingerprint FROM " + q + " WHERE consumer = ? AND event_id = ?",
		}
	default:
		return identityStatements{
			stored: "SELECT event_name, fingerprint FROM " + q + " WHERE consumer = $1 AND event_id = $2",
		}
	}
}

// ClaimParams is one PostgreSQL claim statement with its parameters
// unboxed, for a driver that encodes them itself (the middleware's pgx
// beginner sends it as a prepared statement with binary parameters). It is
// the statement and the arguments of ClaimQueryAt, or of
// ClaimIdentityQueryAt when Identity is set, in the same order: $1
// Consumer (text), $2 EventID (uuid), $3 EventAt (timestamptz; NULL when
// HasEventAt is false, dated now() by the server), and with Identity $4
// EventName (text, cut to MaxStoredEventName bytes) and $5 Fingerprint
// (bytea).
//
// On the plain layout SQL is the lean claim (postgresLeanClaim): a UUIDv7
// row without event_at.
type ClaimParams struct {
	SQL string
	// SQLNear is SQL without the replay window's future arm, for a
	// caller that knows the event is dated before the database clock
	// plus MaxFutureSkew when the statement runs (the pgx beginner, from
	// the database clock it read on the connection); "" where there is
	// none (no horizon, not the lean claim). The past arm, which the
	// purge's safety rests on, is in both.
	SQLNear string
	// Pinned: SQL is the lean claim on a schema-qualified table, which no
	// search_path a handler sets can move: its commit may go without the
	// commit guard's statement when every handler statement was seen to
	// keep the transaction (the pgx beginner's scan).
	Pinned   bool
	Consumer string
	// ConsumerID, when not 0, is Consumer's id in <table>_consumer: SQL
	// claims in <table>_v7 (a UUIDv7 event), whose parameters are $1
	// ConsumerID (integer), $2 EventID, $3 EventAt and with Identity $4
	// Fingerprint; no event name.
	ConsumerID int32
	EventID    uuid.UUID
	EventAt    time.Time
	HasEventAt bool
	Identity   bool
	EventName  string
	// Fingerprint[:FingerprintLen] is the fingerprint the claim stores
	// when Identity is set (Identity.AppendFingerprint; length 0: NULL).
	Fingerprint    [fingerprintSize]byte
	FingerprintLen uint8
}

// ClaimParamsAt returns the claim of (consumer, eventID) dated at (see
// ClaimQueryAt), with id's columns when id is not nil, as ClaimParams;
// ok=false for a store whose dialect is not PostgreSQL.
func (s *Store) ClaimParamsAt(consumer string, eventID uuid.UUID, at time.Time, id *Identity) (p ClaimParams, ok bool) {
	if s.dialect != sqldb.PostgreSQL {
		return ClaimParams{}, false
	}
	p = ClaimParams{Consumer: consumer, EventID: eventID}
	if t, ok := EventTime(eventID, at); ok {
		p.EventAt, p.HasEventAt = t, true
	}
	routed := s.routed(eventID)
	switch {
	case s.hasLean:
		v7, withID := 0, 0
		if eventID.Version() == 7 {
			v7 = 1
		}
		if id != nil {
			withID = 1
		}
		// Pinned only on a schema-qualified table: an unqualified one
		// follows the search_path, which a handler's session-level SET
		// may change under a later claim; the guard statement (which
		// names the schema the table resolved to first) catches that
		// claim's move, a scan of the handler's statements would not.
		// NewConsumer qualifies the table it finds.
		p.SQL, p.Pinned = s.lean[v7][withID], s.table.Qualified()
		p.SQLNear = s.leanNear[v7][withID]
		if v7 == 1 && s.claimsV7(consumer, eventID) {
			p.SQL, p.SQLNear, p.ConsumerID = s.v7sql.claim[withID], s.v7sql.near[withID], s.v7ID
		}
	case id != nil && routed:
		p.SQL = s.identity.claimOther
	case id != nil:
		p.SQL = s.identity.claim
	case routed:
		p.SQL = s.other.claim
	default:
		p.SQL = s.claimSQL
	}
	if id != nil {
		p.Identity, p.EventName = true, id.storedName()
		fp, ok := id.AppendFingerprint(p.Fingerprint[:0])
		if len(fp) > len(p.Fingerprint) {
			return ClaimParams{}, false // a stored fingerprint of another size: not a claim's
		}
		if ok {
			p.FingerprintLen = uint8(len(fp))
		}
	}
	return p, true
}
