package newuser_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// The identifiers of this module's packages named in the README (`pkg.Name`
// in text or code) as the README spells them, with the import alias the
// README uses for marshaler/amqp ("idamqp").
var readmePackages = map[string]string{
	"marshaler":   "marshaler",
	"middleware":  "middleware",
	"processed":   "processed",
	"outbox":      "outbox",
	"outboxprom":  "outbox/outboxprom",
	"idempotency": ".",
	"versioned":   "versioned",
	"operation":   "operation",
	"metrics":     "metrics",
	"idamqp":      "marshaler/amqp",
	"mysqlerr":    "middleware/mysqlerr",
}

var readmeRef = regexp.MustCompile(`\b(idempotency|marshaler|middleware|processed|outbox|outboxprom|versioned|operation|metrics|idamqp|mysqlerr)\.([A-Z][A-Za-z0-9_]*)(\.[A-Z][A-Za-z0-9_]*)?`)

// exported returns the top-level names declared in the package in dir
// (types, functions, variables, constants; test files excluded).
func exported(t *testing.T, dir string) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	pkgs, err := parser.ParseDir(token.NewFileSet(), dir, func(fi os.FileInfo) bool {
		return !strings.HasSuffix(fi.Name(), "_test.go")
	}, 0)
	if err != nil {
		t.Fatalf("parse %s: %v", dir, err)
	}
	for _, p := range pkgs {
		for _, f := range p.Files {
			for _, d := range f.Decls {
				switch d := d.(type) {
				case *ast.FuncDecl:
					if d.Recv == nil {
						names[d.Name.Name] = true
					} else if len(d.Recv.List) == 1 {
						recv := d.Recv.List[0].Type
						if st, ok := recv.(*ast.StarExpr); ok {
							recv = st.X
						}
						if id, ok := recv.(*ast.Ident); ok {
							names[id.Name+"."+d.Name.Name] = true
						}
					}
				case *ast.GenDecl:
					for _, s := range d.Specs {
						switch s := s.(type) {
						case *ast.TypeSpec:
							names[s.Name.Name] = true
							if st, ok := s.Type.(*ast.StructType); ok {
								for _, f := range st.Fields.List {
									for _, n := range f.Names {
										names[s.Name.Name+"."+n.Name] = true
									}
								}
							}
						case *ast.ValueSpec:
							for _, n := range s.Names {
								names[n.Name] = true
							}
						}
					}
				}
			}
		}
	}
	return names
}

// Every pkg.Name the README tells a newcomer to use exists in this version
// of the module: a name that does not compile is the first thing a
// newcomer copying the README meets.
//
// Symptom (before the README fix): the README named `marshaler.AMQP{}`
// twice (the hint for a message without UUID, and the default of
// ConfirmedPublisherConfig.Marshaler); package marshaler has no AMQP: the
// envelope marshaler of watermill-amqp is Marshaler{} of package
// marshaler/amqp (idamqp.Marshaler{}).
func TestREADMENamesExist(t *testing.T) {
	t.Parallel()
	docs, _ := filepath.Glob("../../docs/*.md")
	var md []byte
	for _, f := range append([]string{"../../README.md"}, docs...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		md = append(md, b...)
	}
	decls := map[string]map[string]bool{}
	var missing []string
	seen := map[string]bool{}
	for _, m := range readmeRef.FindAllStringSubmatch(string(md), -1) {
		alias, name := m[1], m[2]+m[3]
		ref := alias + "." + name
		if seen[ref] {
			continue
		}
		seen[ref] = true
		dir := readmePackages[alias]
		if decls[dir] == nil {
			decls[dir] = exported(t, filepath.Join("../..", dir))
		}
		if !decls[dir][name] && !(m[3] != "" && decls[dir][m[2]] && !isStructOrHasMembers(decls[dir], m[2])) {
			missing = append(missing, ref+" (package "+dir+")")
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Fatalf("README.md and docs/ name identifiers that do not exist: %s", strings.Join(missing, ", "))
	}
	if len(seen) < 20 {
		t.Fatalf("only %d references found: the pattern no longer matches the README", len(seen))
	}
}

// isStructOrHasMembers reports whether the type name has fields or methods
// recorded (an interface or a named func type has none: its members are not
// checked).
func isStructOrHasMembers(names map[string]bool, typ string) bool {
	for k := range names {
		if strings.HasPrefix(k, typ+".") {
			return true
		}
	}
	return false
}
