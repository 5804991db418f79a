package inbox

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/cenkalti/backoff/v5"
	"github.com/stretchr/testify/require"
)

// Watermill's Retry (v1.5.1) calls NextBackOff once for RetryParams.Delay
// and once for the wait; with the compensated parameters the waits follow
// the documented schedule I, I·m, I·m², …
func TestCompensatedBackoffSchedule(t *testing.T) {
	t.Parallel()
	initial, m := 100*time.Millisecond, 2.0
	ci, cm := compensatedBackoff(initial, m)
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.Multiplier, b.RandomizationFactor, b.MaxInterval = ci, cm, 0, time.Hour
	b.Reset()
	want := initial
	for k := 1; k <= 5; k++ {
		_ = b.NextBackOff() // RetryParams.Delay, computed for ShouldRetry
		wait := b.NextBackOff()
		require.InDelta(t, float64(want), float64(wait), float64(time.Millisecond), "wait %d", k)
		want = time.Duration(float64(want) * m)
	}
}

// A bounded header is at most max bytes, valid UTF-8, and says how long the
// original was.
func TestBoundHeader(t *testing.T) {
	t.Parallel()
	require.Equal(t, "short", bound("short", 64))
	s := strings.Repeat("é", 100) // 200 bytes
	b := bound(s, 64)
	require.LessOrEqual(t, len(b), 64)
	require.True(t, utf8.ValidString(b))
	require.True(t, strings.HasSuffix(b, "…(truncated, 200 bytes)"))
}
