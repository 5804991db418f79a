//go:build !race

// Allocation counts are only meaningful without the race detector, which
// allocates on its own: this file is not built under -race, and
// scripts/test.sh runs its tests in a run of their own without it.

package inbox

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"
)

// The chain's outer layers (hold and poison, retry, recoverer) allocate
// once per delivery on the success path (the chain's context): Watermill's
// Retry, two context values, the hooks and an unused backoff made 16
// allocations per message (bench BenchmarkRouterOneWorker).
func TestChainOuterLayersAllocateOncePerDelivery(t *testing.T) {
	cfg := ChainConfig{}
	cfg.setDefaults()
	p := &holdPoison{cfg: cfg, logger: watermill.NopLogger{}}
	h := p.middleware(p.retry(wmw.Recoverer(func(*message.Message) ([]*message.Message, error) { return nil, nil })))
	msg := message.NewMessage("1", nil)
	msg.SetContext(context.Background())
	allocs := testing.AllocsPerRun(200, func() {
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	})
	require.LessOrEqual(t, allocs, 1.0)
}
