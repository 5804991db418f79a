package readme_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var exampleFunc = regexp.MustCompile(`(?m)^func Example[A-Za-z0-9_]*\(\) \{`)

// Every library package (not internal/, examples/, bench/, e2e/, cmd/) has
// at least one Example function, which go doc shows and go test compiles
// (and runs, with an Output comment).
func TestEveryLibraryPackageHasAnExample(t *testing.T) {
	t.Parallel()
	root := "../.."
	skip := map[string]bool{"internal": true, "examples": true, "bench": true, "e2e": true, "cmd": true, "scripts": true}
	var missing []string
	_ = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		top, _, _ := strings.Cut(rel, string(filepath.Separator))
		if rel != "." && (skip[top] || strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "migrations") {
			return filepath.SkipDir
		}
		srcs, _ := filepath.Glob(filepath.Join(path, "*.go"))
		var lib, example bool
		for _, f := range srcs {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			if strings.HasSuffix(f, "_test.go") {
				example = example || exampleFunc.Match(b)
			} else if !strings.Contains(string(b), "package main\n") && filepath.Base(f) != "doc.go" {
				lib = true // a package with code (a doc.go alone documents a test-only package)
			}
		}
		if lib && rel != "." && !example {
			missing = append(missing, rel)
		}
		return nil
	})
	if len(missing) > 0 {
		t.Fatalf("library packages without an Example function: %v", missing)
	}
}
