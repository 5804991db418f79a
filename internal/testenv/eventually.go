package testenv

import (
	"fmt"
	"strings"
	"time"
)

// DefaultPollInterval is how often Eventually evaluates its condition.
const DefaultPollInterval = 10 * time.Millisecond

// Observed collects what one evaluation of an Eventually condition saw, so
// that a timeout reports the last observed state instead of only "false".
// Record values with Int, Bool, Str or See.
type Observed struct {
	seen []string
}

// See records name=value (formatted with %v) and returns value.
func See[T any](o *Observed, name string, value T) T {
	o.seen = append(o.seen, fmt.Sprintf("%s=%v", name, value))
	return value
}

// Int records name=v and returns v.
func (o *Observed) Int(name string, v int) int { return See(o, name, v) }

// Bool records name=v and returns v.
func (o *Observed) Bool(name string, v bool) bool { return See(o, name, v) }

// Str records name=v (quoted) and returns v.
func (o *Observed) Str(name string, v string) string {
	o.seen = append(o.seen, fmt.Sprintf("%s=%q", name, v))
	return v
}

// Err records name=err and returns whether err is nil.
func (o *Observed) Err(name string, err error) bool {
	o.seen = append(o.seen, fmt.Sprintf("%s=%v", name, err))
	return err == nil
}

// String is the recorded values, comma-separated, or "nothing recorded".
func (o *Observed) String() string {
	if len(o.seen) == 0 {
		return "nothing recorded"
	}
	return strings.Join(o.seen, ", ")
}

// TB is the part of testing.TB Eventually uses.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Eventually evaluates cond every DefaultPollInterval until it returns true
// and fails the test when timeout passes first, with what the test waited
// for and what the last evaluation recorded in its Observed:
//
//	waited 15s for "E1 processed": last seen effects(E1)=0, ready(queue)=1
//
// cond runs on the test goroutine; each evaluation gets a fresh Observed.
// Call it from the test goroutine only (it calls Fatalf).
func Eventually(t TB, timeout time.Duration, what string, cond func(o *Observed) bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		o := &Observed{}
		if cond(o) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %s: last seen %s", timeout, what, o)
			return
		}
		time.Sleep(DefaultPollInterval)
	}
}
