package sqldb

import (
	"fmt"
	"regexp"
	"strings"
)

// identPart is a conservative SQL identifier: a letter or underscore, then
// letters, digits or underscores, at most 63 bytes (PostgreSQL's NAMEDATALEN-1).
// Anything else is refused rather than escaped, so a name from configuration can
// never carry SQL.
var identPart = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Ident is a validated, possibly schema-qualified SQL identifier such as
// "processed_event" or "inbox.processed_event". Build one with ParseIdent.
type Ident struct {
	parts []string
}

// ParseIdent validates name: one or two dot-separated parts (schema.table),
// each matching [A-Za-z_][A-Za-z0-9_]{0,62}. The error names the offending part.
func ParseIdent(name string) (Ident, error) {
	if name == "" {
		return Ident{}, fmt.Errorf("empty identifier")
	}
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return Ident{}, fmt.Errorf("identifier %q: at most schema.name", name)
	}
	for _, p := range parts {
		if !identPart.MatchString(p) {
			return Ident{}, fmt.Errorf("identifier %q: part %q must match %s", name, p, identPart)
		}
	}
	return Ident{parts: parts}, nil
}

// Name is the last part (the table name without its schema).
func (i Ident) Name() string {
	if len(i.parts) == 0 {
		return ""
	}
	return i.parts[len(i.parts)-1]
}

// String is the unquoted dotted form, as given.
func (i Ident) String() string { return strings.Join(i.parts, ".") }

// Qualified reports whether the identifier names its schema.
func (i Ident) Qualified() bool { return len(i.parts) > 1 }

// Quoted returns the identifier quoted with the given quote character
// ('"' for PostgreSQL and SQLite, '`' for MySQL). Validation already excluded
// quote characters, so no escaping is needed.
func (i Ident) Quoted(quote byte) string {
	q := string(quote)
	out := make([]string, len(i.parts))
	for n, p := range i.parts {
		out[n] = q + p + q
	}
	return strings.Join(out, ".")
}

// IsZero reports whether the identifier is unset.
func (i Ident) IsZero() bool { return len(i.parts) == 0 }
