package readme_test

import (
	"os"
	"strings"
	"testing"
)

// snippet is the text between "// README:<name>begin" and
// "// README:<name>end" in example_test.go (name "" is the consumer,
// "producer:" the producer).
func snippet(t *testing.T, name string) string {
	t.Helper()
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(src), "// README:"+name+"begin\n")
	body, _, ok2 := strings.Cut(rest, "// README:"+name+"end\n")
	if !ok || !ok2 {
		t.Fatalf("example_test.go: README:%sbegin / README:%send markers missing", name, name)
	}
	return strings.Trim(body, "\n")
}

// readmeBlock is README.md's ```go block that starts with the line
// "// "+tag, without that line.
func readmeBlock(t *testing.T, tag string) string {
	t.Helper()
	md, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(md), "```go\n// "+tag+"\n")
	code, _, ok2 := strings.Cut(block, "\n```")
	if !ok || !ok2 {
		t.Fatalf("README.md: no ```go block starting with // %s", tag)
	}
	return code
}

// readmeSnippet is the consumer's quick start (the block tagged quickstart).
func readmeSnippet(t *testing.T) string { return readmeBlock(t, "quickstart") }

// The quick start is at most 35 lines of code (comments and blank lines
// aside), and wires a consumer from the pool to the router in at most 20:
// from NewConsumer to AddConsumerHandler's closing line.
func TestREADMEQuickStartIsShort(t *testing.T) {
	t.Parallel()
	code := readmeSnippet(t)
	n, wiring, inWiring := 0, 0, false
	for _, l := range strings.Split(code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "//") {
			continue
		}
		n++
		if strings.Contains(l, "middleware.NewConsumer(") {
			inWiring = true
		}
		if inWiring {
			wiring++
			if strings.HasPrefix(l, "}); err != nil") {
				inWiring = false
			}
		}
	}
	if n > 35 {
		t.Errorf("README quick start: %d code lines, at most 35", n)
	}
	if wiring == 0 || wiring > 20 {
		t.Errorf("README quick start: consumer wiring %d lines (NewConsumer … AddConsumerHandler), want 1..20", wiring)
	}
}

// The README's snippets are the compiled runStock, placeOrder and
// runRelay, character for character.
func TestREADMESnippet(t *testing.T) {
	t.Parallel()
	sameText(t, snippet(t, ""), readmeSnippet(t))
	sameText(t, snippet(t, "producer:"), readmeBlock(t, "quickstart producer"))
}

func sameText(t *testing.T, want, got string) {
	t.Helper()
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
