package operation

import (
	"bytes"
	"crypto/sha256"
	"encoding"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// ErrInvalidParams is returned (wrapped) by Fingerprint and Canonical for
// parameters that are not one valid JSON value, or that it refuses (duplicate
// object keys, text that is not valid, an exponent beyond ±maxExponent).
var ErrInvalidParams = errors.New("operation: invalid parameters")

// maxExponent bounds the decimal exponent of a number, after normalisation,
// so that exponent arithmetic cannot overflow. No amount, quantity or id comes
// near it.
const maxExponent = 1_000_000_000

// FingerprintVersion is the version of the canonical form that Fingerprint
// and Canonical write today. Every fingerprint carries its version (a
// "v2:" prefix), so that a later change of the canonical form gets a new
// version and never turns a stored record into a conflict: a stored
// fingerprint is compared with the algorithm of its own version.
//
// Versions:
//
//   - 1 (records written before versions existed: 64 hex digits, no prefix):
//     SHA-256 of the version-1 canonical text, in which time offsets were
//     kept as written and text that is not valid (invalid UTF-8 in a Go
//     string, a lone surrogate escape) was replaced by U+FFFD.
//   - 2: the canonical text described at Canonical: date-times normalised to
//     UTC, text that is not valid refused.
const FingerprintVersion = 2

// fingerprintPrefix starts every version-2 fingerprint.
const fingerprintPrefix = "v2:"

// Fingerprint returns the fingerprint of Canonical(params): the identity of
// the request an operation key was first used with. It is 64 characters,
// "v2:" (the FingerprintVersion) followed by the first 61 lower-case hex
// digits (244 bits) of the SHA-256 of the canonical text, so it fits the
// varchar(64) column of the MySQL schema. Equal requests give equal
// fingerprints; any other request gives another one (barring a collision).
//
// Put in params exactly the values that define the request to the provider
// (amount, currency, account, …) and nothing that varies between attempts of
// the same operation (a timestamp, a delivery count, a trace id): a varying
// value makes every retry a conflict.
func Fingerprint(params any) (string, error) {
	c, err := Canonical(params)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(c)
	return fingerprintPrefix + hex.EncodeToString(sum[:])[:64-len(fingerprintPrefix)], nil
}

// fingerprintV1 is the version-1 fingerprint of params: 64 hex digits of the
// SHA-256 of the version-1 canonical text. It is kept to compare records
// written before versions existed.
func fingerprintV1(params any) (string, error) {
	raw, err := paramsJSON(params, false)
	if err != nil {
		return "", err
	}
	c, err := canonicalText(raw, 1)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(c)
	return hex.EncodeToString(sum[:]), nil
}

// SameRequest reports whether params are the request whose fingerprint was
// stored, comparing with the algorithm of the stored fingerprint's version:
//
//   - a version-2 fingerprint ("v2:…") is compared with Fingerprint(params);
//   - a version-1 fingerprint (64 hex digits without prefix, written before
//     versions existed) with the version-1 algorithm, so such a record keeps
//     matching the requests it matched before (and a time written with
//     another offset than at the first call still differs, as it did);
//   - a fingerprint of a later version ("vN:…" with N > FingerprintVersion,
//     written by a newer release of this package during a rolling upgrade)
//     cannot be recomputed here and is accepted as the same request: the
//     stored outcome is then served, and nothing is called twice;
//   - anything else is not the same request.
//
// It returns an error wrapping ErrInvalidParams when params themselves are
// refused by Canonical.
func SameRequest(stored string, params any) (bool, error) {
	fp, err := Fingerprint(params)
	if err != nil {
		return false, err
	}
	return sameRequest(stored, fp, params), nil
}

// sameRequest is SameRequest with Fingerprint(params) already computed as fp.
func sameRequest(stored, fp string, params any) bool {
	if stored == fp {
		return true
	}
	switch v := fingerprintVersionOf(stored); {
	case v == 1:
		old, err := fingerprintV1(params)
		return err == nil && old == stored
	case v > FingerprintVersion:
		return true
	default:
		return false
	}
}

// fingerprintVersionOf returns the version a stored fingerprint was written
// with, or 0 when it is none this package knows the shape of.
func fingerprintVersionOf(stored string) int {
	if len(stored) == 64 && isLowerHex(stored) {
		return 1
	}
	if len(stored) < 3 || stored[0] != 'v' {
		return 0
	}
	digits, _, ok := strings.Cut(stored[1:], ":")
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n < 2 || strconv.Itoa(n) != digits {
		return 0
	}
	return n
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// Canonical returns the canonical JSON text of params, the text Fingerprint
// hashes (version FingerprintVersion). params is a []byte or json.RawMessage
// holding JSON text, or any other value, which is encoded with encoding/json
// first (a Go string is therefore a JSON string, not JSON text).
//
// What counts as equal (two inputs with the same canonical text):
//
//   - Object members in any order, and any JSON whitespace between tokens.
//     Members are written sorted by the bytes of their UTF-8 names.
//   - Numbers with the same exact decimal value, however spelled: 1, 1.0,
//     1e0, 10E-1 and 0.1e1 are equal; 0, -0 and 0.000 are equal. The
//     comparison is exact, with no float64 rounding: 0.1 and
//     0.1000000000000000000001 differ, and so do 9007199254740993 and
//     9007199254740992. A number is written as its shortest integer
//     coefficient and a decimal exponent ("1", "15e-1", "-25e2").
//   - Strings with the same characters after JSON unescaping: "é" and
//     "\u00e9" are equal. No Unicode normalisation is applied (NFC "é" and
//     NFD "é" differ), and case matters.
//   - Date-times that denote the same instant, whatever their offset: a
//     time.Time, and any JSON string that is an RFC 3339 date-time
//     (YYYY-MM-DDThh:mm:ss[.fraction](Z|±hh:mm), "T" and "Z" in either case,
//     at most nine fractional digits), is written in UTC, RFC 3339 with full
//     precision and no trailing zeros. So time.Date(2024, 7, 1, 12, 0, 0, 0,
//     paris) and the same instant in UTC, "2024-07-01T12:00:00+02:00" and
//     "2024-07-01T10:00:00.000Z" are equal (pgx returns timestamptz values
//     in the process's local zone: TZ must not change a fingerprint). The
//     precision is kept: 10:00:00.000000001Z and 10:00:00Z differ. A string
//     that is not such a date-time (another layout, a leap second, a year
//     outside 0000-9999 once in UTC) is compared as text.
//
// What differs: any changed value; a number and a string of the same digits
// (100 and "100"); null and a missing member; false and null; an empty array
// and an empty object; the order of array elements. A Go float64 is encoded
// by encoding/json as its shortest round-trip decimal, so 0.1+0.2 is not 0.3:
// use integer minor units or decimal strings for money.
//
// Refused, with an error wrapping ErrInvalidParams: invalid JSON, trailing
// data after the value, an object with a duplicate member name (which JSON
// parsers resolve differently), a number whose normalised exponent exceeds
// one billion in magnitude, and text that is not valid, never silently
// replaced: bytes that are not UTF-8 in the JSON text or in a Go string, map
// key or MarshalText result of params (encoding/json would write U+FFFD,
// so that "DE89\xff" and "DE89\xfe" would be one request), and a \u escape
// of a lone UTF-16 surrogate ("\ud800" alone, which decoders also turn into
// U+FFFD).
func Canonical(params any) ([]byte, error) {
	raw, err := paramsJSON(params, true)
	if err != nil {
		return nil, err
	}
	return canonicalText(raw, FingerprintVersion)
}

// paramsJSON returns the JSON text of params: the bytes themselves, or the
// encoding/json encoding of a Go value. With strict, a Go value holding text
// that is not valid UTF-8 (which encoding/json would replace) is refused.
func paramsJSON(params any, strict bool) ([]byte, error) {
	switch p := params.(type) {
	case json.RawMessage:
		return p, nil
	case []byte:
		return p, nil
	}
	b, err := json.Marshal(params)
	if err != nil {
		return nil, fmt.Errorf("%w: encode %T: %w", ErrInvalidParams, params, err)
	}
	if strict {
		// Marshal succeeded, so params has no cycle for the walk to follow.
		if path, bad := invalidText(reflect.ValueOf(params), "", 0); bad {
			return nil, fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidParams, path)
		}
	}
	return b, nil
}

// canonicalText is the canonical text of the JSON text raw, in the given
// version of the canonical form.
func canonicalText(raw []byte, version int) ([]byte, error) {
	if !utf8.Valid(raw) {
		return nil, fmt.Errorf("%w: not valid UTF-8", ErrInvalidParams)
	}
	if version >= 2 && hasLoneSurrogate(raw) {
		return nil, fmt.Errorf("%w: a lone UTF-16 surrogate escape (not a character)", ErrInvalidParams)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	c := canon{dec: dec, version: version}
	var out bytes.Buffer
	if err := c.value(&out); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidParams, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: data after the JSON value", ErrInvalidParams)
	}
	return out.Bytes(), nil
}

// canon writes the canonical form of one version.
type canon struct {
	dec     *json.Decoder
	version int
}

func (c canon) value(out *bytes.Buffer) error {
	tok, err := c.dec.Token()
	if err != nil {
		if err == io.EOF {
			return errors.New("no JSON value")
		}
		return err
	}
	return c.token(tok, out)
}

func (c canon) token(tok json.Token, out *bytes.Buffer) error {
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			return c.object(out)
		case '[':
			out.WriteByte('[')
			for n := 0; c.dec.More(); n++ {
				if n > 0 {
					out.WriteByte(',')
				}
				if err := c.value(out); err != nil {
					return err
				}
			}
			if _, err := c.dec.Token(); err != nil { // ']'
				return err
			}
			out.WriteByte(']')
			return nil
		}
		return fmt.Errorf("unexpected %q", t)
	case string:
		if c.version >= 2 {
			if u, ok := utcDateTime(t); ok {
				t = u
			}
		}
		writeString(out, t)
	case json.Number:
		n, err := canonNumber(string(t))
		if err != nil {
			return err
		}
		out.WriteString(n)
	case bool:
		out.WriteString(strconv.FormatBool(t))
	case nil:
		out.WriteString("null")
	default:
		return fmt.Errorf("unexpected token %T", tok)
	}
	return nil
}

func (c canon) object(out *bytes.Buffer) error {
	type member struct {
		name  string
		value []byte
	}
	var members []member
	seen := map[string]bool{}
	for c.dec.More() {
		tok, err := c.dec.Token()
		if err != nil {
			return err
		}
		name, ok := tok.(string)
		if !ok {
			return fmt.Errorf("object member name %v is not a string", tok)
		}
		if seen[name] {
			return fmt.Errorf("duplicate object member %q", name)
		}
		seen[name] = true
		var v bytes.Buffer
		if err := c.value(&v); err != nil {
			return err
		}
		members = append(members, member{name, v.Bytes()})
	}
	if _, err := c.dec.Token(); err != nil { // '}'
		return err
	}
	slices.SortFunc(members, func(a, b member) int { return strings.Compare(a.name, b.name) })
	out.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			out.WriteByte(',')
		}
		writeString(out, m.name)
		out.WriteByte(':')
		out.Write(m.value)
	}
	out.WriteByte('}')
	return nil
}

// writeString writes s as a JSON string: encoding/json's escaping without its
// HTML escaping, so the text depends only on s.
func writeString(out *bytes.Buffer, s string) {
	enc := json.NewEncoder(out)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // a valid UTF-8 string always encodes
	out.Truncate(out.Len() - 1)
}

// canonNumber rewrites a JSON number literal (already validated by the
// decoder) as sign, shortest integer coefficient and decimal exponent.
func canonNumber(lit string) (string, error) {
	neg := strings.HasPrefix(lit, "-")
	lit = strings.TrimPrefix(lit, "-")
	mant, expText, hasExp := strings.Cut(strings.ToLower(lit), "e")
	exp := int64(0)
	if hasExp {
		e, err := strconv.ParseInt(expText, 10, 64)
		if err != nil || e > maxExponent || e < -maxExponent {
			return "", fmt.Errorf("number %s: exponent out of range", lit)
		}
		exp = e
	}
	intPart, frac, _ := strings.Cut(mant, ".")
	digits := strings.TrimLeft(intPart+frac, "0")
	exp -= int64(len(frac))
	if digits == "" {
		return "0", nil
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits) - len(trimmed))
	if exp > maxExponent || exp < -maxExponent {
		return "", fmt.Errorf("number %s: exponent out of range", lit)
	}
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	b.WriteString(trimmed)
	if exp != 0 {
		b.WriteByte('e')
		b.WriteString(strconv.FormatInt(exp, 10))
	}
	return b.String(), nil
}

// utcDateTime returns s rewritten in UTC when it is an RFC 3339 date-time
// (section 5.6) with at most nine fractional digits: RFC 3339 with
// nanoseconds, trailing zeros dropped, "Z". ok is false for any other string,
// which is then compared as text.
func utcDateTime(s string) (string, bool) {
	// YYYY-MM-DDThh:mm:ss is 19 bytes, "Z" the shortest offset.
	if len(s) < 20 || len(s) > 35 {
		return "", false
	}
	for i := 0; i < 19; i++ {
		c := s[i]
		switch i {
		case 4, 7:
			if c != '-' {
				return "", false
			}
		case 10:
			if c != 'T' && c != 't' {
				return "", false
			}
		case 13, 16:
			if c != ':' {
				return "", false
			}
		default:
			if c < '0' || c > '9' {
				return "", false
			}
		}
	}
	rest := s[19:]
	if rest[0] == '.' {
		n := 1
		for n < len(rest) && '0' <= rest[n] && rest[n] <= '9' {
			n++
		}
		if n == 1 || n > 10 { // no digit, or below a nanosecond
			return "", false
		}
		rest = rest[n:]
	}
	switch {
	case rest == "Z" || rest == "z":
	case len(rest) == 6 && (rest[0] == '+' || rest[0] == '-') && rest[3] == ':' &&
		isDigits(rest[1:3]) && isDigits(rest[4:6]) && rest[1:3] <= "23" && rest[4:6] <= "59":
	default:
		return "", false
	}
	b := []byte(s)
	b[10] = 'T'
	if b[len(b)-1] == 'z' {
		b[len(b)-1] = 'Z'
	}
	t, err := time.Parse(time.RFC3339Nano, string(b))
	if err != nil { // a field out of range (month 13, hour 24, second 60)
		return "", false
	}
	t = t.UTC()
	if y := t.Year(); y < 0 || y > 9999 {
		return "", false
	}
	return t.Format(time.RFC3339Nano), true
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// hasLoneSurrogate reports whether the valid JSON text raw holds a \u escape
// of a UTF-16 surrogate that is not half of an escaped pair (a high one,
// U+D800 to U+DBFF, followed by a low one, U+DC00 to U+DFFF). Such an escape
// denotes no character; decoders replace it by U+FFFD.
func hasLoneSurrogate(raw []byte) bool {
	i := bytes.IndexByte(raw, '\\')
	if i < 0 {
		return false
	}
	// In valid JSON a backslash only occurs inside a string, starting an
	// escape of two characters or six (\uXXXX).
	for ; i+1 < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' {
			i++ // the escaped character, which may be a backslash
			continue
		}
		r := hexRune(raw[i+2:])
		switch {
		case 0xD800 <= r && r < 0xDC00:
			if len(raw) >= i+12 && raw[i+6] == '\\' && raw[i+7] == 'u' {
				if lo := hexRune(raw[i+8:]); 0xDC00 <= lo && lo < 0xE000 {
					i += 11
					continue
				}
			}
			return true
		case 0xDC00 <= r && r < 0xE000:
			return true
		}
		i += 5
	}
	return false
}

// hexRune reads four hex digits at the start of b, or returns -1.
func hexRune(b []byte) rune {
	if len(b) < 4 {
		return -1
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			r = r<<4 | rune(c-'0')
		case 'a' <= c && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case 'A' <= c && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return -1
		}
	}
	return r
}

var (
	jsonMarshalerType = reflect.TypeFor[json.Marshaler]()
	textMarshalerType = reflect.TypeFor[encoding.TextMarshaler]()
)

// maxWalkDepth bounds invalidText's recursion; encoding/json itself refuses
// cycles, and no request nests this deep.
const maxWalkDepth = 10_000

// invalidText looks, in what encoding/json encodes of v, for text that is not
// valid UTF-8 (encoding/json writes it as U+FFFD, silently): strings, map
// keys and MarshalText results. It returns the path of the first one found
// (".Account", "[2]", `["iban"]`), never its value. A MarshalJSON result is
// not walked: its bytes are kept as they are by encoding/json, and checked as
// JSON text by canonicalText.
func invalidText(v reflect.Value, path string, depth int) (string, bool) {
	if !v.IsValid() || depth > maxWalkDepth {
		return "", false
	}
	t := v.Type()
	if t.Kind() == reflect.Pointer || t.Kind() == reflect.Interface {
		if v.IsNil() {
			return "", false
		}
	}
	if t.Implements(jsonMarshalerType) || v.CanAddr() && reflect.PointerTo(t).Implements(jsonMarshalerType) {
		return "", false
	}
	if v.CanInterface() && (t.Implements(textMarshalerType) || v.CanAddr() && reflect.PointerTo(t).Implements(textMarshalerType)) {
		m, ok := v.Interface().(encoding.TextMarshaler)
		if !ok && v.CanAddr() {
			m, ok = v.Addr().Interface().(encoding.TextMarshaler)
		}
		if ok {
			if text, err := m.MarshalText(); err == nil && !utf8.Valid(text) {
				return pathOrRoot(path), true
			}
		}
		return "", false
	}
	switch t.Kind() {
	case reflect.String:
		if !utf8.ValidString(v.String()) {
			return pathOrRoot(path), true
		}
	case reflect.Pointer, reflect.Interface:
		return invalidText(v.Elem(), path, depth+1)
	case reflect.Struct:
		for i := 0; i < t.NumField(); i++ {
			f := t.Field(i)
			if !f.IsExported() && !(f.Anonymous && indirectKind(f.Type) == reflect.Struct) {
				continue // encoding/json encodes exported fields, and those promoted from embedded structs
			}
			if tag := f.Tag.Get("json"); tag == "-" {
				continue
			}
			if p, bad := invalidText(v.Field(i), path+"."+f.Name, depth+1); bad {
				return p, true
			}
		}
	case reflect.Map:
		it := v.MapRange()
		for it.Next() {
			k := it.Key()
			kp := path + "[…]"
			if k.Kind() == reflect.String && !k.Type().Implements(textMarshalerType) {
				if !utf8.ValidString(k.String()) {
					return "a map key of " + pathOrRoot(path), true
				}
				kp = path + "[" + strconv.Quote(k.String()) + "]"
			} else if p, bad := invalidText(k, path+"[key]", depth+1); bad {
				return p, true
			}
			if p, bad := invalidText(it.Value(), kp, depth+1); bad {
				return p, true
			}
		}
	case reflect.Slice, reflect.Array:
		if t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Uint8 &&
			!t.Elem().Implements(jsonMarshalerType) && !t.Elem().Implements(textMarshalerType) {
			return "", false // []byte: base64
		}
		for i := 0; i < v.Len(); i++ {
			if p, bad := invalidText(v.Index(i), path+"["+strconv.Itoa(i)+"]", depth+1); bad {
				return p, true
			}
		}
	}
	return "", false
}

func indirectKind(t reflect.Type) reflect.Kind {
	if t.Kind() == reflect.Pointer {
		return t.Elem().Kind()
	}
	return t.Kind()
}

func pathOrRoot(path string) string {
	if path == "" {
		return "the value"
	}
	return "the value at " + path
}
