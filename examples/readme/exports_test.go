package readme_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// maxExports is the public surface's budget: exported identifiers of the
// library packages (types, functions, constants, variables, and methods of
// exported types), test files and examples/, cmd/, bench/, internal/ and
// testdata/ left out.
const maxExports = 450

// The library's public surface stays within maxExports; the count per
// package is logged (go test -v -run TestExportedIdentifiers ./readme).
func TestExportedIdentifiersWithinBudget(t *testing.T) {
	t.Parallel()
	root := "../.."
	skip := map[string]bool{"examples": true, "cmd": true, "bench": true, "internal": true, "testdata": true, "vendor": true}
	counts := map[string]int{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (skip[d.Name()] || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.SkipObjectResolution)
		if err != nil || f.Name.Name == "main" {
			return nil
		}
		rel, _ := filepath.Rel(root, filepath.Dir(p))
		counts[rel] += exportedIn(f)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	pkgs := make([]string, 0, len(counts))
	for p, n := range counts {
		pkgs = append(pkgs, p)
		total += n
	}
	sort.Strings(pkgs)
	for _, p := range pkgs {
		t.Logf("%-28s %d", p, counts[p])
	}
	t.Logf("total %d (budget %d)", total, maxExports)
	if total > maxExports {
		t.Fatalf("%d exported identifiers in the library packages, budget %d", total, maxExports)
	}
}

func exportedIn(f *ast.File) int {
	n := 0
	for _, decl := range f.Decls {
		switch d := decl.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() {
				continue
			}
			if d.Recv != nil && len(d.Recv.List) > 0 {
				typ := d.Recv.List[0].Type
				if s, ok := typ.(*ast.StarExpr); ok {
					typ = s.X
				}
				if ix, ok := typ.(*ast.IndexExpr); ok {
					typ = ix.X
				}
				if id, ok := typ.(*ast.Ident); ok && !id.IsExported() {
					continue
				}
			}
			n++
		case *ast.GenDecl:
			for _, spec := range d.Specs {
				switch s := spec.(type) {
				case *ast.TypeSpec:
					if s.Name.IsExported() {
						n++
					}
				case *ast.ValueSpec:
					for _, name := range s.Names {
						if name.IsExported() {
							n++
						}
					}
				}
			}
		}
	}
	return n
}
