package inbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestPgxImplementationsAreExplicit: our types that satisfy a pgx
// interface embed that interface (nil), so a method a newer pgx adds is
// promoted and never breaks a user's build (pgx v5.12 added
// BatchResults.Tx). The embedded value is nil: a promoted method panics
// when called. So every method of the interface of the pgx version we build
// against must be declared on our type itself; this test fails, naming the
// method, when an upgrade added one we have not implemented yet.
func TestPgxImplementationsAreExplicit(t *testing.T) {
	t.Parallel()
	declared := declaredMethods(t)
	for typ, iface := range map[string]reflect.Type{
		"pgxTx":              reflect.TypeOf((*pgx.Tx)(nil)).Elem(),
		"closedBatchResults": reflect.TypeOf((*pgx.BatchResults)(nil)).Elem(),
		"errRow":             reflect.TypeOf((*pgx.Row)(nil)).Elem(),
	} {
		if declared[typ] == nil {
			t.Errorf("type %s declares no methods in package middleware", typ)
			continue
		}
		for i := range iface.NumMethod() {
			m := iface.Method(i).Name
			if !declared[typ][m] {
				t.Errorf("%s does not declare %s.%s itself (the embedded nil %s would panic): implement it", typ, iface, m, iface)
			}
		}
	}
}

// declaredMethods returns the methods declared in the package's non-test
// files, by receiver type name.
func declaredMethods(t *testing.T) map[string]map[string]bool {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]bool{}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv == nil || len(fn.Recv.List) != 1 {
				continue
			}
			rt := fn.Recv.List[0].Type
			if s, ok := rt.(*ast.StarExpr); ok {
				rt = s.X
			}
			id, ok := rt.(*ast.Ident)
			if !ok {
				continue
			}
			if out[id.Name] == nil {
				out[id.Name] = map[string]bool{}
			}
			out[id.Name][fn.Name.Name] = true
		}
	}
	return out
}
