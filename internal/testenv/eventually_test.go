package testenv_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

type fatalTB struct{ msg string }

func (*fatalTB) Helper() {}
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
}

// A timeout names what was awaited and the values of the last evaluation.
func TestEventuallyReportsLastObservedState(t *testing.T) {
	t.Parallel()
	f := &fatalTB{}
	n := 0
	testenv.Eventually(f, 50*time.Millisecond, "three effects", func(o *testenv.Observed) bool {
		n++
		return o.Int("effects", 1) == 3 && o.Bool("never", true)
	})
	want := "waited 50ms for three effects: last seen effects=1"
	if f.msg != want {
		t.Fatalf("message %q, want %q", f.msg, want)
	}
	if n < 2 {
		t.Fatalf("condition evaluated %d times, want polling", n)
	}
	f = &fatalTB{}
	testenv.Eventually(f, time.Second, "x", func(o *testenv.Observed) bool {
		return o.Str("state", "ok") == "ok" && testenv.See(o, "n", 2) == 2
	})
	if f.msg != "" {
		t.Fatalf("condition held, yet: %s", f.msg)
	}
	f = &fatalTB{}
	testenv.Eventually(f, 0, "nothing", func(*testenv.Observed) bool { return false })
	if !strings.HasSuffix(f.msg, "last seen nothing recorded") {
		t.Fatalf("message %q", f.msg)
	}
}
