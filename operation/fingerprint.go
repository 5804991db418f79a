package operation

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ErrInvalidParams is returned (wrapped) by Fingerprint and Canonical for
// parameters that are not one valid JSON value, or that it refuses (duplicate
// object keys, invalid UTF-8, an exponent beyond ±maxExponent).
var ErrInvalidParams = errors.New("operation: invalid parameters")

// maxExponent bounds the decimal exponent of a number, after normalisation,
// so that exponent arithmetic cannot overflow. No amount, quantity or id comes
// near it.
const maxExponent = 1_000_000_000

// Fingerprint returns the SHA-256, as 64 lower-case hex digits, of
// Canonical(params): the identity of the request an operation key was first
// used with. Equal requests give equal fingerprints; any other request gives
// another one (barring a SHA-256 collision).
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
	return hex.EncodeToString(sum[:]), nil
}

// Canonical returns the canonical JSON text of params, the text Fingerprint
// hashes. params is a []byte or json.RawMessage holding JSON text, or any
// other value, which is encoded with encoding/json first (a Go string is
// therefore a JSON string, not JSON text).
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
//
// What differs: any changed value; a number and a string of the same digits
// (100 and "100"); null and a missing member; false and null; an empty array
// and an empty object; the order of array elements. A Go float64 is encoded
// by encoding/json as its shortest round-trip decimal, so 0.1+0.2 is not 0.3:
// use integer minor units or decimal strings for money.
//
// Refused, with an error wrapping ErrInvalidParams: invalid JSON, trailing
// data after the value, invalid UTF-8, an object with a duplicate member name
// (which JSON parsers resolve differently), and a number whose normalised
// exponent exceeds one billion in magnitude.
func Canonical(params any) ([]byte, error) {
	var raw []byte
	switch p := params.(type) {
	case json.RawMessage:
		raw = p
	case []byte:
		raw = p
	default:
		b, err := json.Marshal(params)
		if err != nil {
			return nil, fmt.Errorf("%w: encode %T: %w", ErrInvalidParams, params, err)
		}
		raw = b
	}
	if !utf8.Valid(raw) {
		return nil, fmt.Errorf("%w: not valid UTF-8", ErrInvalidParams)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var out bytes.Buffer
	if err := canonValue(dec, &out); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidParams, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%w: data after the JSON value", ErrInvalidParams)
	}
	return out.Bytes(), nil
}

func canonValue(dec *json.Decoder, out *bytes.Buffer) error {
	tok, err := dec.Token()
	if err != nil {
		if err == io.EOF {
			return errors.New("no JSON value")
		}
		return err
	}
	return canonToken(dec, tok, out)
}

func canonToken(dec *json.Decoder, tok json.Token, out *bytes.Buffer) error {
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			return canonObject(dec, out)
		case '[':
			out.WriteByte('[')
			for n := 0; dec.More(); n++ {
				if n > 0 {
					out.WriteByte(',')
				}
				if err := canonValue(dec, out); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil { // ']'
				return err
			}
			out.WriteByte(']')
			return nil
		}
		return fmt.Errorf("unexpected %q", t)
	case string:
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

func canonObject(dec *json.Decoder, out *bytes.Buffer) error {
	type member struct {
		name  string
		value []byte
	}
	var members []member
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
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
		if err := canonValue(dec, &v); err != nil {
			return err
		}
		members = append(members, member{name, v.Bytes()})
	}
	if _, err := dec.Token(); err != nil { // '}'
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
