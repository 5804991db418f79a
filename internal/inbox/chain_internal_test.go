package inbox

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// The chain's retry waits I, I·m, I·m², … (±20 % jitter, capped at
// MaxInterval) between attempts of an ordinary error, MaxRetries times,
// restoring the message's context before each attempt; the waits are read
// from its log, not timed.
func TestChainRetryWaitsFollowTheDocumentedSchedule(t *testing.T) {
	t.Parallel()
	cfg := ChainConfig{MaxRetries: 4, InitialInterval: time.Millisecond, MaxInterval: 4 * time.Millisecond, Multiplier: 2}
	cfg.setDefaults()
	log := watermill.NewCaptureLogger()
	p := &holdPoison{cfg: cfg, logger: log}
	attempts := 0
	var leaked bool
	h := p.retry(func(msg *message.Message) ([]*message.Message, error) {
		attempts++
		leaked = leaked || msg.Context().Value(leakKey{}) != nil
		msg.SetContext(context.WithValue(msg.Context(), leakKey{}, true))
		return nil, errors.New("ordinary")
	})
	msg := message.NewMessage("1", nil)
	msg.SetContext(&chainCtx{Context: context.Background(), p: p})
	_, err := h(msg)
	require.EqualError(t, err, "ordinary")
	require.Equal(t, 5, attempts, "one attempt and MaxRetries retries")
	require.False(t, leaked, "each attempt starts from the message's own context")
	var waits []time.Duration
	for _, e := range log.Captured()[watermill.ErrorLogLevel] {
		require.Equal(t, "Error occurred, retrying", e.Msg)
		waits = append(waits, e.Fields["wait_time"].(time.Duration))
	}
	want := []time.Duration{1, 2, 4, 4} // ms: doubled, capped at MaxInterval
	require.Len(t, waits, len(want))
	for i, w := range want {
		w *= time.Millisecond
		require.GreaterOrEqual(t, waits[i], w*8/10, "wait %d", i+1)
		require.LessOrEqual(t, waits[i], w*12/10, "wait %d", i+1)
	}
}

type leakKey struct{}
