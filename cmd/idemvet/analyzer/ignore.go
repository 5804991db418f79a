package analyzer

import (
	"go/ast"
	"go/token"
	"os"
	"strings"

	"golang.org/x/tools/go/analysis"
)

// ignoreDirective silences the diagnostics of its line. Written at the end
// of a line, it covers a diagnostic that starts or ends on that line;
// written alone on a line, it covers a diagnostic that starts on the next.
// A reason is required: without one the directive silences nothing and is
// itself reported.
const ignoreDirective = "idemvet:ignore"

type ignoreComment struct {
	comment    *ast.Comment
	line       int
	standalone bool
	reason     string
}

type ignores struct {
	fset   *token.FileSet
	byFile map[string][]ignoreComment
}

func newIgnores(pass *analysis.Pass) *ignores {
	read := pass.ReadFile
	if read == nil {
		read = os.ReadFile
	}
	return collectIgnores(pass.Fset, pass.Files, read)
}

// collectIgnores reads the directives of the package's files.
func collectIgnores(fset *token.FileSet, files []*ast.File, readFile func(string) ([]byte, error)) *ignores {
	ig := &ignores{fset: fset, byFile: make(map[string][]ignoreComment)}
	for _, f := range files {
		var src []byte
		for _, g := range f.Comments {
			for _, cm := range g.List {
				text, ok := strings.CutPrefix(cm.Text, "//")
				if !ok {
					continue
				}
				rest, ok := strings.CutPrefix(strings.TrimLeft(text, " \t"), ignoreDirective)
				if !ok || rest != "" && rest[0] != ' ' && rest[0] != '\t' {
					continue
				}
				pos := fset.Position(cm.Slash)
				if src == nil {
					src, _ = readFile(pos.Filename)
				}
				ig.byFile[pos.Filename] = append(ig.byFile[pos.Filename], ignoreComment{
					comment:    cm,
					line:       pos.Line,
					standalone: aloneOnLine(src, pos.Offset),
					reason:     strings.TrimSpace(rest),
				})
			}
		}
	}
	return ig
}

// aloneOnLine reports whether only blanks precede offset on its line. A
// file that cannot be read counts as trailing (the narrower reading).
func aloneOnLine(src []byte, offset int) bool {
	if offset > len(src) || len(src) == 0 {
		return false
	}
	for i := offset - 1; i >= 0 && src[i] != '\n'; i-- {
		if src[i] != ' ' && src[i] != '\t' {
			return false
		}
	}
	return true
}

// covers reports whether a directive with a reason covers n.
func (ig *ignores) covers(n ast.Node) bool {
	start, end := ig.fset.Position(n.Pos()), ig.fset.Position(n.End())
	for _, d := range ig.byFile[start.Filename] {
		if d.reason == "" {
			continue
		}
		if d.standalone && d.line == start.Line-1 || !d.standalone && (d.line == start.Line || d.line == end.Line) {
			return true
		}
	}
	return false
}

// reportMissingReasons reports the directives without a reason.
func (ig *ignores) reportMissingReasons(c *checker) {
	for _, ds := range ig.byFile {
		for _, d := range ds {
			if d.reason == "" {
				c.report(d.comment, ruleIgnore, "idemvet: //idemvet:ignore needs a reason: //idemvet:ignore <why this effect is safe outside the attempt>")
			}
		}
	}
}
