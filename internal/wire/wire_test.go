package wire

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// A bounded header is at most max bytes, valid UTF-8 (the cut never splits
// a rune), starts with the original's prefix and says how long the original
// was; a value within the bound is returned as is.
func TestBoundKeepsAHeaderWithinMaxBytesOnARuneBoundary(t *testing.T) {
	t.Parallel()
	if got := Bound("short", 64); got != "short" {
		t.Fatalf("Bound(short) = %q", got)
	}
	for _, max := range []int{64, 65, 66, 4096} {
		s := strings.Repeat("é", 3000) // 6000 bytes
		b := Bound(s, max)
		if len(b) > max || !utf8.ValidString(b) || !strings.HasSuffix(b, "…(truncated, 6000 bytes)") {
			t.Fatalf("Bound(%d) = %q (%d bytes)", max, b, len(b))
		}
		if p := strings.TrimSuffix(b, "…(truncated, 6000 bytes)"); !strings.HasPrefix(s, p) || len(p) < max-len("…(truncated, 6000 bytes)")-1 {
			t.Fatalf("Bound(%d) kept %d bytes of the prefix", max, len(p))
		}
	}
	if b := Bound(strings.Repeat("x", 100), 10); len(b) > len("…(truncated, 100 bytes)") {
		t.Fatalf("a max below the suffix keeps only the suffix: %q", b)
	}
}
