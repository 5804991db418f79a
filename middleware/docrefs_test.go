package middleware_test

import (
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// processedRef is a reference to the processed package in prose:
// processed.X or processed.X.Y (a field or method of X).
var processedRef = regexp.MustCompile(`\bprocessed\.([A-Z][A-Za-z0-9_]*)(?:\.([A-Z][A-Za-z0-9_]*))?`)

// The middleware package's comments name the processed package's API
// (processed.X, processed.X.Y) only by identifiers, fields and methods it
// exports: a user who follows a reference finds what it names.
func TestConsumerDocReferencesExistingProcessedFields(t *testing.T) {
	t.Parallel()
	// The package's compiled export data (go list -export builds it, or
	// finds it in the build cache): type-checking it and all it imports
	// from source would take half a minute.
	const path = "github.com/watermill-idempotency/idempotency/processed"
	out, err := exec.Command("go", "list", "-export", "-f", "{{.Export}}", path).Output()
	require.NoError(t, err, "go list -export %s", path)
	export := strings.TrimSpace(string(out))
	pkg, err := importer.ForCompiler(token.NewFileSet(), "gc", func(p string) (io.ReadCloser, error) {
		if p != path {
			return nil, fmt.Errorf("unexpected import of %s", p)
		}
		return os.Open(export)
	}).Import(path)
	require.NoError(t, err, "read the export data of package processed")

	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	refs := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		require.NoError(t, err)
		f, err := parser.ParseFile(fset, name, src, parser.ParseComments)
		require.NoError(t, err)
		for _, group := range f.Comments {
			for _, c := range group.List {
				for _, m := range processedRef.FindAllStringSubmatch(c.Text, -1) {
					refs++
					if msg := resolveProcessed(pkg, m[1], m[2]); msg != "" {
						t.Errorf("%s: %q: %s", fset.Position(c.Pos()), m[0], msg)
					}
				}
			}
		}
	}
	require.NotZero(t, refs, "the middleware package's comments reference package processed")
}

// resolveProcessed returns why processed.x(.y) names nothing exported, or "".
func resolveProcessed(pkg *types.Package, x, y string) string {
	obj := pkg.Scope().Lookup(x)
	if obj == nil || !obj.Exported() {
		return "package processed exports no " + x
	}
	if y == "" {
		return ""
	}
	found, _, _ := types.LookupFieldOrMethod(obj.Type(), true, pkg, y)
	if found == nil || !ast.IsExported(found.Name()) {
		return x + " has no exported field or method " + y
	}
	return ""
}
