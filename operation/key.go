package operation

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxKeyLen is the longest key text NewKey builds, in bytes: 255, the limit
// several payment providers put on their idempotency keys (Stripe, Adyen), so
// a key can be passed to them as is.
const MaxKeyLen = 255

// kindPattern is what a kind may be: a lower-case word, as in "charge",
// "refund", "email.confirmation".
var kindPattern = regexp.MustCompile(`^[a-z][a-z0-9_.-]{0,62}$`)

// ErrInvalidKey is returned (wrapped) by NewKey and ParseKey for a key that
// breaks the rules below, and by Runner methods for the zero Key.
var ErrInvalidKey = errors.New("operation: invalid key")

// Key names one operation: its kind, the entity it acts on and, when one
// entity has several operations of that kind, the intent that tells them
// apart. It is the same for every attempt, redelivery and manual replay of the
// operation, and it is what the provider receives as its idempotency key.
//
// Its text is "kind:entity[:intent…]", for example "charge:p-1" or
// "refund:p-1:partial-2". In the entity and intent parts, '%', ':' and every
// character outside printable Unicode are percent-encoded (UTF-8 bytes as
// %XX, upper-case hex), so the text is unambiguous: two different (kind,
// entity, intent…) tuples never give the same key.
//
// Never derive a key from anything that changes between attempts: the event
// id of a message that a producer may publish again under a new id, a
// delivery count, a timestamp or a random value drawn per attempt. A random
// value drawn once, stored with the entity and reused, is fine.
//
// The zero Key is invalid. Keys compare with ==.
type Key struct {
	kind string
	text string
}

// NewKey builds the key of the operation kind on entity, qualified by intent
// parts if any. kind must match [a-z][a-z0-9_.-]{0,62}; entity and every
// intent part must be non-empty, valid UTF-8; the whole text must fit in
// MaxKeyLen bytes. The errors wrap ErrInvalidKey. NewKey is deterministic:
// the same arguments give the same key in every process and version.
func NewKey(kind, entity string, intent ...string) (Key, error) {
	if !kindPattern.MatchString(kind) {
		return Key{}, fmt.Errorf("%w: kind %q must match %s", ErrInvalidKey, kind, kindPattern)
	}
	var b strings.Builder
	b.WriteString(kind)
	for i, part := range append([]string{entity}, intent...) {
		if part == "" {
			return Key{}, fmt.Errorf("%w: %s: part %d is empty", ErrInvalidKey, kind, i+1)
		}
		if !utf8.ValidString(part) {
			return Key{}, fmt.Errorf("%w: %s: part %d is not valid UTF-8", ErrInvalidKey, kind, i+1)
		}
		b.WriteByte(':')
		escapePart(&b, part)
	}
	if b.Len() > MaxKeyLen {
		return Key{}, fmt.Errorf("%w: %s: %d bytes, more than %d", ErrInvalidKey, kind, b.Len(), MaxKeyLen)
	}
	return Key{kind: kind, text: b.String()}, nil
}

// MustKey is NewKey that panics on an invalid key: for keys built from
// constants and values already validated.
func MustKey(kind, entity string, intent ...string) Key {
	k, err := NewKey(kind, entity, intent...)
	if err != nil {
		panic(err)
	}
	return k
}

// ParseKey accepts a key text as String returns it (for example from the
// MetadataKey of a reconciliation message) and returns the Key. It refuses,
// with an error wrapping ErrInvalidKey, any text NewKey would not have
// produced, including non-canonical escapes ("%3a" for "%3A").
func ParseKey(s string) (Key, error) {
	parts := strings.Split(s, ":")
	if len(parts) < 2 {
		return Key{}, fmt.Errorf("%w: %q: want kind:entity", ErrInvalidKey, s)
	}
	args := make([]string, 0, len(parts)-1)
	for _, p := range parts[1:] {
		u, err := unescapePart(p)
		if err != nil {
			return Key{}, fmt.Errorf("%w: %q: %v", ErrInvalidKey, s, err)
		}
		args = append(args, u)
	}
	k, err := NewKey(parts[0], args[0], args[1:]...)
	if err != nil {
		return Key{}, err
	}
	if k.text != s {
		return Key{}, fmt.Errorf("%w: %q is not canonical (want %q)", ErrInvalidKey, s, k.text)
	}
	return k, nil
}

// String is the key's text, "kind:entity[:intent…]": what the provider
// receives, what the operations table stores.
func (k Key) String() string { return k.text }

// Kind is the key's first part ("charge" in "charge:p-1").
func (k Key) Kind() string { return k.kind }

// IsZero reports whether k is the zero (invalid) Key.
func (k Key) IsZero() bool { return k.text == "" }

const upperHex = "0123456789ABCDEF"

func escapePart(b *strings.Builder, s string) {
	for _, r := range s {
		if r == '%' || r == ':' || !unicode.IsPrint(r) {
			var buf [utf8.UTFMax]byte
			n := utf8.EncodeRune(buf[:], r)
			for _, c := range buf[:n] {
				b.WriteByte('%')
				b.WriteByte(upperHex[c>>4])
				b.WriteByte(upperHex[c&0xF])
			}
			continue
		}
		b.WriteRune(r)
	}
}

func unescapePart(s string) (string, error) {
	if !strings.Contains(s, "%") {
		return s, nil
	}
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			out = append(out, s[i])
			continue
		}
		if i+2 >= len(s) {
			return "", fmt.Errorf("truncated escape at byte %d", i)
		}
		hi, ok1 := hexVal(s[i+1])
		lo, ok2 := hexVal(s[i+2])
		if !ok1 || !ok2 {
			return "", fmt.Errorf("bad escape at byte %d", i)
		}
		out = append(out, hi<<4|lo)
		i += 2
	}
	return string(out), nil
}

func hexVal(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}
