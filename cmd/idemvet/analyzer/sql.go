package analyzer

import (
	"strings"
	"unicode"
)

// sqlStatements splits SQL text into statements (at semicolons) of
// upper-case words. Comments (-- and nested /* */), quoted strings and
// identifiers ('…', E'…', "…", $tag$…$tag$) are dropped, so a keyword inside
// them is not a keyword. Anything else that is not a letter, digit or
// underscore separates words.
func sqlStatements(q string) [][]string {
	var (
		stmts [][]string
		cur   []string
		word  strings.Builder
	)
	flush := func() {
		if word.Len() > 0 {
			cur = append(cur, strings.ToUpper(word.String()))
			word.Reset()
		}
	}
	for i := 0; i < len(q); {
		c := q[i]
		switch {
		case c == '-' && strings.HasPrefix(q[i:], "--"):
			flush()
			if j := strings.IndexByte(q[i:], '\n'); j >= 0 {
				i += j + 1
			} else {
				i = len(q)
			}
		case c == '/' && strings.HasPrefix(q[i:], "/*"):
			flush()
			depth := 0
			for i < len(q) {
				if strings.HasPrefix(q[i:], "/*") {
					depth++
					i += 2
				} else if strings.HasPrefix(q[i:], "*/") {
					depth--
					i += 2
					if depth == 0 {
						break
					}
				} else {
					i++
				}
			}
		case c == '\'' || c == '"':
			// E'…' and friends: the prefix letter was read as a word.
			if c == '\'' && word.Len() == 1 && strings.ContainsRune("EeBbXxNnUu", rune(word.String()[0])) {
				word.Reset()
			}
			flush()
			i = skipQuoted(q, i+1, c)
		case c == '$' && word.Len() == 0:
			if tag, ok := dollarTag(q[i:]); ok {
				flush()
				if j := strings.Index(q[i+len(tag):], tag); j >= 0 {
					i += len(tag) + j + len(tag)
				} else {
					i = len(q)
				}
				continue
			}
			i++
		case c == ';':
			flush()
			if len(cur) > 0 {
				stmts = append(stmts, cur)
				cur = nil
			}
			i++
		case c == '_' || c < 0x80 && (unicode.IsLetter(rune(c)) || unicode.IsDigit(rune(c))):
			word.WriteByte(c)
			i++
		default:
			flush()
			i++
		}
	}
	flush()
	if len(cur) > 0 {
		stmts = append(stmts, cur)
	}
	return stmts
}

// skipQuoted returns the index after the closing quote q of a string that
// starts at i; a doubled quote and a backslash escape do not close it.
func skipQuoted(s string, i int, q byte) int {
	for i < len(s) {
		switch s[i] {
		case '\\':
			i += 2
			continue
		case q:
			if i+1 < len(s) && s[i+1] == q {
				i += 2
				continue
			}
			return i + 1
		}
		i++
	}
	return len(s)
}

// dollarTag returns the opening tag ($$ or $name$) of a PostgreSQL
// dollar-quoted string at the start of s.
func dollarTag(s string) (string, bool) {
	for j := 1; j < len(s); j++ {
		c := s[j]
		if c == '$' {
			return s[:j+1], true
		}
		if c != '_' && !(c < 0x80 && (unicode.IsLetter(rune(c)) || j > 1 && unicode.IsDigit(rune(c)))) {
			return "", false
		}
	}
	return "", false
}

// isWriteSQL reports whether a statement of q writes: its first keyword is
// in writeKeywords, or it is a WITH statement containing one (an UPDATE
// after FOR or KEY is a row lock, not a write).
func isWriteSQL(q string) bool {
	for _, words := range sqlStatements(q) {
		if writeKeywords[words[0]] {
			return true
		}
		if words[0] != "WITH" {
			continue
		}
		for i, w := range words {
			if writeKeywords[w] && !(w == "UPDATE" && i > 0 && (words[i-1] == "FOR" || words[i-1] == "KEY")) {
				return true
			}
		}
	}
	return false
}

// endsTransaction reports the first statement of q that ends the
// transaction it runs in, as written (upper case): COMMIT, END, ABORT,
// ROLLBACK (not ROLLBACK TO [SAVEPOINT] name, which keeps it open),
// PREPARE TRANSACTION, and RELEASE [SAVEPOINT] name unless own reports that
// the same function created that savepoint.
func endsTransaction(q string, own map[string]bool) (string, bool) {
	for _, words := range sqlStatements(q) {
		switch words[0] {
		case "COMMIT", "END", "ABORT":
			return words[0], true
		case "ROLLBACK":
			rest := words[1:]
			if len(rest) > 0 && (rest[0] == "WORK" || rest[0] == "TRANSACTION") {
				rest = rest[1:]
			}
			if len(rest) > 0 && rest[0] == "TO" {
				continue
			}
			return "ROLLBACK", true
		case "PREPARE":
			if len(words) > 1 && words[1] == "TRANSACTION" {
				return "PREPARE TRANSACTION", true
			}
		case "RELEASE":
			rest := words[1:]
			if len(rest) > 0 && rest[0] == "SAVEPOINT" {
				rest = rest[1:]
			}
			if len(rest) > 0 && own[rest[0]] {
				continue
			}
			return "RELEASE SAVEPOINT", true
		}
	}
	return "", false
}

// savepointName returns the name a SAVEPOINT statement of q creates.
func savepointNames(q string) []string {
	var names []string
	for _, words := range sqlStatements(q) {
		if words[0] == "SAVEPOINT" && len(words) > 1 {
			names = append(names, words[1])
		}
	}
	return names
}
