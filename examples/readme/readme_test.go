package readme_test

import (
	"os"
	"strings"
	"testing"
)

// snippet is the text between "// README:begin" and "// README:end" in
// example_test.go, leading tabs as four spaces each (what the README shows).
func snippet(t *testing.T) string {
	t.Helper()
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(src), "// README:begin\n")
	body, _, ok2 := strings.Cut(rest, "// README:end\n")
	if !ok || !ok2 {
		t.Fatal("example_test.go: README:begin / README:end markers missing")
	}
	lines := strings.Split(strings.Trim(body, "\n"), "\n")
	for i, l := range lines {
		trimmed := strings.TrimLeft(l, "\t")
		lines[i] = strings.Repeat("    ", len(l)-len(trimmed)) + trimmed
	}
	return strings.Join(lines, "\n")
}

// readmeSnippet is the first ```go block of README.md's "## Using it".
func readmeSnippet(t *testing.T) string {
	t.Helper()
	md, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(md), "\n## Using it\n")
	if !ok {
		t.Fatal(`README.md: no "## Using it" section`)
	}
	_, block, ok := strings.Cut(section, "```go\n")
	code, _, ok2 := strings.Cut(block, "\n```")
	if !ok || !ok2 {
		t.Fatal("README.md: no ```go block in \"## Using it\"")
	}
	return code
}

// The README's snippet is the compiled runStock, character for character.
func TestREADMESnippet(t *testing.T) {
	t.Parallel()
	want, got := snippet(t), readmeSnippet(t)
	if got == want {
		return
	}
	wl, gl := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := 0; i < len(wl) || i < len(gl); i++ {
		var w, g string
		if i < len(wl) {
			w = wl[i]
		}
		if i < len(gl) {
			g = gl[i]
		}
		if w != g {
			t.Fatalf("README.md's snippet differs from examples/readme/example_test.go at line %d:\nREADME:  %q\nexample: %q\n(copy the code between the README markers into the README)", i+1, g, w)
		}
	}
}
