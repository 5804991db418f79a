package processedstore

import (
	"strings"
	"testing"
	"time"
)

// Every lean claim takes the lock timeout into its WHERE, before the mark
// and the window (the pgx beginner's backstop when the session carries the
// lock timeout); a statement that is not a lean claim is refused, so the
// beginner keeps its SET LOCAL there.
func TestEveryLeanClaimTakesTheLockTimeoutIntoItsWhere(t *testing.T) {
	for _, horizon := range []time.Duration{0, time.Hour} {
		s, err := NewStore(Config{Table: "app.processed_event", Horizon: horizon})
		if err != nil {
			t.Fatal(err)
		}
		for v7 := range s.lean {
			for id := range s.lean[v7] {
				got, ok := LeanClaimWithLockTimeout(s.lean[v7][id], 1500*time.Millisecond)
				if !ok {
					t.Fatalf("lean claim [%d][%d] refused: %s", v7, id, s.lean[v7][id])
				}
				want := "\nWHERE set_config('lock_timeout', '1500ms', true) IS NOT NULL AND " + claimMarkerSQL
				if !strings.Contains(got, want) || strings.Replace(got, "set_config('lock_timeout', '1500ms', true) IS NOT NULL AND ", "", 1) != s.lean[v7][id] {
					t.Fatalf("lean claim [%d][%d]: %s", v7, id, got)
				}
			}
		}
		if _, ok := LeanClaimWithLockTimeout(s.claimSQL, time.Second); ok {
			t.Fatalf("the classic claim was taken: %s", s.claimSQL)
		}
	}
}
