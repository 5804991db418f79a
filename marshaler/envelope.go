package marshaler

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// DefaultMaxSize is the largest envelope, in bytes, that [Decode] and [Decoder]
// accept when no limit is given: 1 MiB (1 << 20 bytes). The limit applies to
// the whole envelope body, not to the payload alone.
const DefaultMaxSize = 1 << 20

// Top-level keys of the envelope. Every other top-level key is an extra field
// (see [Envelope.Extra]). Keys are compared exactly (case-sensitive), after
// JSON unescaping.
const (
	keyEventID    = "event_id"
	keyEventName  = "event_name"
	keyOccurredAt = "occurred_at"
	keyPayload    = "payload"
)

// ErrMalformed is matched (with [errors.Is]) by every error [Decode] returns:
// the bytes are not an envelope this package accepts. Callers branch on it to
// treat the message as permanently undeliverable (dead-letter it, never retry).
var ErrMalformed = errors.New("envelope: malformed")

// ErrNilEventID is matched (with [errors.Is]) by the error of [ParseEventID],
// [Decode] and the producer helpers when the event id is the nil UUID
// (00000000-0000-0000-0000-000000000000, RFC 9562 section 5.9). The nil UUID
// is what an unset id looks like; accepting it would make every such message
// a duplicate of the first one.
var ErrNilEventID = errors.New("nil UUID")

// DecodeError is the error [Decode] returns for each refusal. It matches
// [ErrMalformed] with [errors.Is], and unwraps to the underlying cause when
// there is one (for example [ErrNilEventID]).
type DecodeError struct {
	// Field is the top-level envelope key at fault ("event_id", "event_name",
	// "occurred_at", "payload", or the key repeated for a duplicate key), or
	// "" when the envelope as a whole is refused (empty, over the size limit,
	// not JSON, not a JSON object, trailing data).
	Field string
	// Reason says what is wrong, in a few words. It never quotes the input
	// value, so it is safe to log and to carry in message metadata.
	Reason string

	cause error
}

// Error returns "envelope: <field>: <reason>", or "envelope: <reason>" when
// Field is empty.
func (e *DecodeError) Error() string {
	if e.Field == "" {
		return "envelope: " + e.Reason
	}
	return "envelope: " + e.Field + ": " + e.Reason
}

// Is reports whether target is [ErrMalformed].
func (e *DecodeError) Is(target error) bool { return target == ErrMalformed }

// Unwrap returns the underlying cause (for example [ErrNilEventID]), or nil.
func (e *DecodeError) Unwrap() error { return e.cause }

func refuse(field, reason string) *DecodeError {
	return &DecodeError{Field: field, Reason: reason}
}

// Envelope is one event as it travels on the wire:
//
//	{"event_id": "<uuid>", "event_name": "order.placed",
//	 "occurred_at": "2024-07-01T10:00:00.000Z", "payload": <any JSON value>, ...}
//
// Build one by hand, with [Decode], or with [ToEnvelope]; write it with
// [Envelope.Encode].
type Envelope struct {
	// EventID identifies the event, not the delivery: the producer sets it once
	// and every copy (outbox republish, broker redelivery, manual replay)
	// carries the same value. It is the deduplication key. Never the nil UUID.
	EventID uuid.UUID
	// EventName is the event type, for example "order.placed". Never empty.
	EventName string
	// OccurredAt is when the event happened, at full precision (nanoseconds)
	// and with the offset it was written with.
	OccurredAt time.Time
	// Payload is the event body: one JSON value (null included), kept as the
	// exact bytes received. It is never re-encoded.
	Payload json.RawMessage
	// Extra holds every other top-level field, by key, as raw JSON bytes, so
	// that fields this package does not know survive a decode/encode round
	// trip. Nil when there are none. Keys must not be one of the four fields
	// above.
	Extra map[string]json.RawMessage

	// occurredAtText is occurred_at exactly as decoded. Encode writes it back
	// unchanged as long as OccurredAt still denotes the same instant with the
	// same offset, so "10:00:00.000Z" is not rewritten as "10:00:00Z".
	occurredAtText string
}

// Decode parses and validates one envelope. maxSize is the largest accepted
// len(data) in bytes; 0 or less means [DefaultMaxSize].
//
// The envelope must be a single JSON object (whitespace around it is allowed,
// anything else after it is not) with no duplicate top-level key, and:
//   - event_id: a JSON string holding a UUID in any form [ParseEventID]
//     accepts, not the nil UUID; it is canonicalised.
//   - event_name: a non-empty JSON string.
//   - occurred_at: a JSON string holding an RFC 3339 date-time, see
//     [Envelope.OccurredAt] and [OccurredAt] for what is accepted.
//   - payload: present, any JSON value including null (a missing key is
//     refused: it is far more often a producer bug than an event without
//     data). Kept byte for byte; whitespace around the value is not part of it.
//
// Other top-level keys go to [Envelope.Extra] unchanged.
//
// Every top-level key and every value but the payload must be valid text: a
// string holding bytes that are not UTF-8, or a \u escape of a lone UTF-16
// surrogate (\ud800 alone), is refused with the field named, never replaced by
// U+FFFD (which encoding/json does silently), so the handler never sees other
// text than the producer sent. The payload is not checked: it is passed on
// byte for byte and decoded by the handler.
//
// Each refusal is a [*DecodeError] matching [ErrMalformed].
func Decode(data []byte, maxSize int) (Envelope, error) {
	if maxSize <= 0 {
		maxSize = DefaultMaxSize
	}
	if len(data) > maxSize {
		return Envelope{}, refuse("", fmt.Sprintf("%d bytes, over the limit of %d bytes", len(data), maxSize))
	}
	if len(data) == 0 {
		return Envelope{}, refuse("", "empty body")
	}
	if !json.Valid(data) {
		// Unmarshal reports where and why; Valid only says no.
		var raw json.RawMessage
		err := json.Unmarshal(data, &raw)
		reason := "not valid JSON"
		if err != nil {
			reason += ": " + err.Error()
		}
		return Envelope{}, refuse("", reason)
	}

	fields, err := splitObject(data)
	if err != nil {
		return Envelope{}, err
	}

	var env Envelope

	raw, ok := fields[keyEventID]
	if !ok {
		return Envelope{}, refuse(keyEventID, "missing")
	}
	s, derr := jsonString(keyEventID, raw)
	if derr != nil {
		return Envelope{}, derr
	}
	id, reason, cause := parseEventID(s)
	if reason != "" {
		return Envelope{}, &DecodeError{Field: keyEventID, Reason: reason, cause: cause}
	}
	env.EventID = id

	raw, ok = fields[keyEventName]
	if !ok {
		return Envelope{}, refuse(keyEventName, "missing")
	}
	if env.EventName, derr = jsonString(keyEventName, raw); derr != nil {
		return Envelope{}, derr
	}

	raw, ok = fields[keyOccurredAt]
	if !ok {
		return Envelope{}, refuse(keyOccurredAt, "missing")
	}
	if s, derr = jsonString(keyOccurredAt, raw); derr != nil {
		return Envelope{}, derr
	}
	t, err := parseRFC3339(s)
	if err != nil {
		return Envelope{}, &DecodeError{Field: keyOccurredAt, Reason: err.Error(), cause: err}
	}
	env.OccurredAt = t
	env.occurredAtText = s

	raw, ok = fields[keyPayload]
	if !ok {
		return Envelope{}, refuse(keyPayload, "missing")
	}
	env.Payload = raw

	for _, k := range []string{keyEventID, keyEventName, keyOccurredAt, keyPayload} {
		delete(fields, k)
	}
	if len(fields) > 0 {
		env.Extra = fields
	}
	return env, nil
}

// splitObject returns the top-level members of data, which must already be
// valid JSON, as raw values. The raw values are copies of the input bytes.
//
// Every key, and every value except the payload's, must be valid text (see
// textProblem): encoding/json would otherwise replace what is not by U+FFFD,
// silently, so that the handler would see other bytes than the producer sent.
// The payload is kept byte for byte and never decoded here, so it is not
// checked: the handler's own decoder sees exactly what was sent.
func splitObject(data []byte) (map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, refuse("", "not valid JSON: "+err.Error())
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, refuse("", "not a JSON object")
	}
	fields := make(map[string]json.RawMessage)
	for dec.More() {
		before := dec.InputOffset()
		tok, err = dec.Token()
		if err != nil {
			return nil, refuse("", "not valid JSON: "+err.Error())
		}
		key, ok := tok.(string)
		if !ok {
			return nil, refuse("", "not valid JSON: object key is not a string")
		}
		// data[before:InputOffset] is the separator and the key as written.
		if reason := textProblem(data[before:dec.InputOffset()]); reason != "" {
			return nil, refuse("", "a top-level key is "+reason)
		}
		if _, dup := fields[key]; dup {
			return nil, refuse(key, "duplicate key")
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, refuse("", "not valid JSON: "+err.Error())
		}
		if key != keyPayload {
			if reason := textProblem(raw); reason != "" {
				return nil, refuse(key, reason)
			}
		}
		fields[key] = raw
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return nil, refuse("", "not valid JSON: "+err.Error())
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, refuse("", "data after the JSON object")
	}
	return fields, nil
}

// jsonString decodes raw as a non-empty JSON string.
func jsonString(field string, raw json.RawMessage) (string, *DecodeError) {
	if len(raw) == 0 || raw[0] != '"' {
		return "", refuse(field, "not a JSON string (got "+jsonKind(raw)+")")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", refuse(field, "not a JSON string")
	}
	if s == "" {
		return "", refuse(field, "empty")
	}
	return s, nil
}

// textProblem says why the JSON bytes raw are not valid text, or returns ""
// when they are. raw is valid JSON, or a fragment of it that starts outside a
// string. Refused: bytes that are not UTF-8 (RFC 8259 section 8.1), and
// \u escapes of a lone UTF-16 surrogate (a high one, U+D800 to U+DBFF, not
// followed by an escaped low one, U+DC00 to U+DFFF, or a low one alone), which
// denote no character (RFC 8259 section 8.2). encoding/json decodes both as
// U+FFFD without an error.
func textProblem(raw []byte) string {
	if !utf8.Valid(raw) {
		return "not valid UTF-8"
	}
	i := bytes.IndexByte(raw, '\\')
	if i < 0 {
		return ""
	}
	// In valid JSON a backslash only occurs inside a string, starting an
	// escape: \", \\, \/, \b, \f, \n, \r, \t or \uXXXX.
	for ; i+1 < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // skip the escaped character, which may be a backslash
			continue
		}
		r, ok := hex4(raw[i+2:])
		if !ok {
			return "not valid JSON: bad \\u escape"
		}
		switch {
		case 0xD800 <= r && r < 0xDC00:
			if len(raw) >= i+12 && raw[i+6] == '\\' && raw[i+7] == 'u' {
				if lo, ok := hex4(raw[i+8:]); ok && 0xDC00 <= lo && lo < 0xE000 {
					i += 11
					continue
				}
			}
			return "a lone UTF-16 surrogate escape (not a character)"
		case 0xDC00 <= r && r < 0xE000:
			return "a lone UTF-16 surrogate escape (not a character)"
		}
		i += 5
	}
	return ""
}

// hex4 reads four hex digits at the start of b.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		v, ok := fromHex(c)
		if !ok {
			return 0, false
		}
		r = r<<4 | rune(v)
	}
	return r, true
}

func jsonKind(raw json.RawMessage) string {
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case 'n':
		return "null"
	case 't', 'f':
		return "boolean"
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	default:
		return "number"
	}
}

// Encode writes the envelope as compact JSON: event_id (canonical RFC 9562
// form), event_name, occurred_at, payload, then the extra fields sorted by
// key. The output is deterministic and [Decode] accepts it (size aside).
//
// occurred_at is the text it was decoded from when OccurredAt still denotes
// the same instant with the same offset; otherwise OccurredAt formatted as
// RFC 3339 with nanoseconds (trailing zeros dropped) and its own offset, "Z"
// for UTC. An offset that is not a whole number of minutes (RFC 3339 cannot
// write one) is converted to UTC.
//
// Payload and extra values are written byte for byte, never re-encoded.
// Encode refuses the nil EventID ([ErrNilEventID]), an empty or non-UTF-8
// EventName, a year outside 0000-9999, a Payload or extra value that is not
// valid JSON, an extra value that is not valid text (as [Decode] would
// refuse it), and an extra key that names one of the four envelope fields.
func (e Envelope) Encode() ([]byte, error) {
	if e.EventID == uuid.Nil {
		return nil, fmt.Errorf("envelope: encode: event_id: %w", ErrNilEventID)
	}
	if e.EventName == "" {
		return nil, errors.New("envelope: encode: event_name: empty")
	}
	if !utf8.ValidString(e.EventName) {
		return nil, errors.New("envelope: encode: event_name: not valid UTF-8")
	}
	occurredAt, err := e.occurredAtString()
	if err != nil {
		return nil, fmt.Errorf("envelope: encode: occurred_at: %w", err)
	}
	if !json.Valid(e.Payload) {
		return nil, errors.New("envelope: encode: payload: not valid JSON (use null for no payload)")
	}
	keys := make([]string, 0, len(e.Extra))
	for k, v := range e.Extra {
		switch k {
		case keyEventID, keyEventName, keyOccurredAt, keyPayload:
			return nil, fmt.Errorf("envelope: encode: extra field %q: names an envelope field", k)
		}
		if !utf8.ValidString(k) {
			return nil, errors.New("envelope: encode: extra field key: not valid UTF-8")
		}
		if !json.Valid(v) {
			return nil, fmt.Errorf("envelope: encode: extra field %q: not valid JSON", k)
		}
		if reason := textProblem(v); reason != "" {
			return nil, fmt.Errorf("envelope: encode: extra field %q: %s", k, reason)
		}
		keys = append(keys, k)
	}
	sort.Strings(keys)

	var buf bytes.Buffer
	buf.Grow(len(e.Payload) + 128)
	buf.WriteByte('{')
	writeMember(&buf, keyEventID, quote(e.EventID.String()))
	buf.WriteByte(',')
	writeMember(&buf, keyEventName, quote(e.EventName))
	buf.WriteByte(',')
	writeMember(&buf, keyOccurredAt, quote(occurredAt))
	buf.WriteByte(',')
	writeMember(&buf, keyPayload, e.Payload)
	for _, k := range keys {
		buf.WriteByte(',')
		writeMember(&buf, k, e.Extra[k])
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

func writeMember(buf *bytes.Buffer, key string, value []byte) {
	buf.Write(quote(key))
	buf.WriteByte(':')
	buf.Write(value)
}

// quote returns s as a JSON string, without HTML escaping (which would be
// valid but needlessly hard to read).
func quote(s string) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a string always encodes
	return bytes.TrimSuffix(buf.Bytes(), []byte{'\n'})
}

// occurredAtString is the occurred_at text Encode and FromEnvelope write.
func (e Envelope) occurredAtString() (string, error) {
	if e.occurredAtText != "" {
		if t, err := parseRFC3339(e.occurredAtText); err == nil && sameTime(t, e.OccurredAt) {
			return e.occurredAtText, nil
		}
	}
	return formatRFC3339(e.OccurredAt)
}

// sameTime reports whether a and b are the same instant written with the same
// offset.
func sameTime(a, b time.Time) bool {
	_, ao := a.Zone()
	_, bo := b.Zone()
	return a.Equal(b) && ao == bo
}

// formatRFC3339 writes t as RFC 3339 with nanoseconds, refusing what RFC 3339
// cannot write.
func formatRFC3339(t time.Time) (string, error) {
	if _, off := t.Zone(); off%60 != 0 {
		t = t.UTC()
	}
	if y := t.Year(); y < 0 || y > 9999 {
		return "", fmt.Errorf("year %d outside 0000-9999 (RFC 3339)", y)
	}
	return t.Format(time.RFC3339Nano), nil
}

// parseRFC3339 parses an RFC 3339 date-time (section 5.6):
//
//	YYYY-MM-DD "T" hh:mm:ss [ "." 1*DIGIT ] ( "Z" / ("+" / "-") hh:mm )
//
// "T" and "Z" may be lower case (RFC 3339 allows it). Any number of fractional
// digits is accepted; digits past the ninth (below a nanosecond) are dropped.
// A leap second (ss = 60) is refused: time.Time cannot hold one. The grammar
// is checked here because time.Parse is lenient (it accepts a comma before the
// fraction, one-digit hours, and offsets out of range).
func parseRFC3339(s string) (time.Time, error) {
	bad := errors.New("not an RFC 3339 date-time")
	if len(s) < len("2006-01-02T15:04:05Z") {
		return time.Time{}, bad
	}
	for i, c := range []byte(s[:19]) {
		switch i {
		case 4, 7:
			if c != '-' {
				return time.Time{}, bad
			}
		case 10:
			if c != 'T' && c != 't' {
				return time.Time{}, bad
			}
		case 13, 16:
			if c != ':' {
				return time.Time{}, bad
			}
		default:
			if !isDigit(c) {
				return time.Time{}, bad
			}
		}
	}
	rest := s[19:]
	if rest[0] == '.' {
		n := 1
		for n < len(rest) && isDigit(rest[n]) {
			n++
		}
		if n == 1 {
			return time.Time{}, bad
		}
		rest = rest[n:]
	}
	switch {
	case rest == "Z" || rest == "z":
	case len(rest) == 6 && (rest[0] == '+' || rest[0] == '-') &&
		isDigit(rest[1]) && isDigit(rest[2]) && rest[3] == ':' && isDigit(rest[4]) && isDigit(rest[5]):
		if rest[1:3] > "23" || rest[4:6] > "59" {
			return time.Time{}, errors.New("not an RFC 3339 date-time: offset out of range")
		}
	default:
		return time.Time{}, bad
	}
	norm := s
	if s[10] == 't' || s[len(s)-1] == 'z' {
		b := []byte(s)
		b[10] = 'T'
		if b[len(b)-1] == 'z' {
			b[len(b)-1] = 'Z'
		}
		norm = string(b)
	}
	t, err := time.Parse(time.RFC3339Nano, norm)
	if err != nil {
		// Only range errors get here (month 13, February 30, hour 24, second 60).
		return time.Time{}, errors.New("not an RFC 3339 date-time: a field is out of range")
	}
	return t, nil
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// ParseEventID parses an event id written in any of the UUID text forms of
// RFC 9562 (section 4) and their common variants, and returns it; its String
// method gives the canonical form (lower case, hyphenated, 36 characters).
// Accepted, hex digits in either case:
//
//	f81d4fae-7dec-11d0-a765-00a0c91e6bf6            canonical
//	F81D4FAE-7DEC-11D0-A765-00A0C91E6BF6            upper case
//	{f81d4fae-7dec-11d0-a765-00a0c91e6bf6}          braces
//	f81d4fae7dec11d0a76500a0c91e6bf6                32 hex digits, no hyphens
//	urn:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6   URN (prefix in any case)
//
// Nothing else is accepted: no surrounding whitespace, no other braces or
// hyphen positions. The version and variant bits are not checked (an id from a
// producer using UUIDv4 is as good as a UUIDv7). The nil UUID is refused with
// an error matching [ErrNilEventID]; the error text names the reason.
func ParseEventID(s string) (uuid.UUID, error) {
	id, reason, cause := parseEventID(s)
	if reason != "" {
		if cause != nil {
			return uuid.Nil, fmt.Errorf("event id: %w", cause)
		}
		return uuid.Nil, errors.New("event id: " + reason)
	}
	return id, nil
}

// parseEventID returns the id, or a reason (and a cause for sentinels).
func parseEventID(s string) (uuid.UUID, string, error) {
	const canonicalLen = 36
	switch {
	case s == "":
		return uuid.Nil, "empty", nil
	case len(s) == canonicalLen+9 && strings.EqualFold(s[:9], "urn:uuid:"):
		s = s[9:]
	case len(s) == canonicalLen+2 && s[0] == '{' && s[len(s)-1] == '}':
		s = s[1 : len(s)-1]
	case len(s) == 32 || len(s) == canonicalLen:
	default:
		return uuid.Nil, fmt.Sprintf("not a UUID (%d characters)", len(s)), nil
	}
	var id uuid.UUID
	var union byte
	if len(s) == canonicalLen {
		for _, j := range [...]int{8, 13, 18, 23} {
			if s[j] != '-' {
				return uuid.Nil, "not a UUID (hyphen expected at position " + fmt.Sprint(j+1) + ")", nil
			}
		}
		// The 8-4-4-4-12 groups, each a run of digits.
		union = decodeHex(id[0:4], s[0:8]) | decodeHex(id[4:6], s[9:13]) | decodeHex(id[6:8], s[14:18]) |
			decodeHex(id[8:10], s[19:23]) | decodeHex(id[10:16], s[24:36])
	} else {
		union = decodeHex(id[:], s)
	}
	if union > 0x0f {
		return uuid.Nil, "not a UUID (not a hex digit)", nil
	}
	if id == uuid.Nil {
		return uuid.Nil, ErrNilEventID.Error(), ErrNilEventID
	}
	return id, "", nil
}

func fromHex(c byte) (byte, bool) {
	v := hexValue[c]
	return v, v != 0xff
}

// decodeHex decodes the pairs of digits of src into dst (len(src) is
// 2 × len(dst)) and returns the union of the digits' values: a digit's
// value is below 16 and anything else's 0xff (hexValue), so one test of
// the union after the loop replaces two per byte.
func decodeHex(dst []byte, src string) (union byte) {
	src = src[:2*len(dst)]
	for i := range dst {
		hi, lo := hexValue[src[2*i]], hexValue[src[2*i+1]]
		union |= hi | lo
		dst[i] = hi<<4 | lo
	}
	return union
}

// hexValue maps a hexadecimal digit (either case) to its value and every
// other byte to 0xff.
var hexValue = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for c := byte('0'); c <= '9'; c++ {
		t[c] = c - '0'
	}
	for c := byte('a'); c <= 'f'; c++ {
		t[c], t[c-'a'+'A'] = c-'a'+10, c-'a'+10
	}
	return t
}()
