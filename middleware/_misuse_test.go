package middleware_test

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// deliveries counts, per handler, how often the router entered the chain.
type deliveries struct {
	mu sync.Mutex
	n  map[string]int
}

func (d *deliveries) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d.mu.Lock()
		if d.n == nil {
			d.n = map[string]int{}
		}
		d.n[message.HandlerNameFromCtx(msg.Context())]++
		d.mu.Unlock()
		return h(msg)
	}
}

func (d *deliveries) of(handler string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.n[handler]
}

// window is how long the misuse tests let a router spin (a sampling
// window: with the old code 2 malformed messages were redelivered
// ≈ 45,000 times in 10 s).
const window = 3 * time.Second

// C.12 (a): a router with the idempotent middleware but without the chain.
// A malformed message is rejected as permanent and the router nacks it; the
// middleware notices it runs outside the chain and slows each failure down
// (UnchainedFailureDelay), so the redeliveries are bounded.
func TestMisuseWithoutChainDoesNotSpin(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	var d deliveries
	stop := runRouter(t, func(router *message.Router) {
		router.AddMiddleware(d.middleware, e.idempotent(e.pool).Middleware)
		router.AddNoPublisherHandler("stock", r.queue, r.subscriber(), func(*message.Message) error { return nil })
	})
	r.publishRaw("not json")
	r.publishRaw(`{"event_id":`)
	time.Sleep(window) // sampling window
	stop()
	n := d.of("stock")
	t.Logf("%d deliveries of 2 malformed messages in %s", n, window)
	require.GreaterOrEqual(t, n, 1)
	require.LessOrEqual(t, n, 2*int(window/middleware.UnchainedFailureDelay)+2, "bounded: about one redelivery per second")
}

// C.12 (b): the chain at router level also wraps the handler of the poison
// queue. The first handler poisons the two malformed messages once each;
// the dead-letter handler's chain rejects them again but sees they are
// consumed from the poison topic and holds them instead of re-poisoning:
// no loop, the poison queue gets each once.
func TestMisuseRouterLevelChainOnDeadLetterHandlerDoesNotLoop(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := newRabbit(t)
	chain, err := middleware.NewChain(middleware.ChainConfig{
		Idempotent: e.idempotent(e.pool), PoisonPublisher: r.poisonPublisher(), PoisonTopic: r.dlq,
		InitialInterval: 10 * time.Millisecond, MaxInterval: 100 * time.Millisecond, MaxHold: time.Second,
	}, nil)
	require.NoError(t, err)
	var d deliveries
	var mu sync.Mutex
	var reasons []string
	stop := runRouter(t, func(router *message.Router) {
		router.AddMiddleware(d.middleware)
		router.AddMiddleware(chain...)
		router.AddNoPublisherHandler("stock", r.queue, r.subscriber(), func(*message.Message) error { return nil })
		router.AddNoPublisherHandler("dead-letters", r.dlq, r.subscriber(), func(msg *message.Message) error {
			mu.Lock()
			reasons = append(reasons, msg.Metadata.Get(wmw.ReasonForPoisonedKey))
			mu.Unlock()
			return nil
		})
	})
	r.publishRaw("not json")
	r.publishRaw(`{"event_id":`)
	time.Sleep(window) // sampling window
	stop()
	t.Logf("stock %d, dead-letters %d deliveries in %s", d.of("stock"), d.of("dead-letters"), window)
	require.Equal(t, 2, d.of("stock"), "each poisoned once, acked")
	require.GreaterOrEqual(t, d.of("dead-letters"), 1)
	require.LessOrEqual(t, d.of("dead-letters"), 2*int(window/time.Second)+2, "held, not re-poisoned in a loop")
	require.Eventually(t, func() bool { return r.depth(r.dlq) == 2 }, 10*time.Second, 20*time.Millisecond,
		"the poison queue holds each message once (the held one back after the nack at shutdown)")
}
