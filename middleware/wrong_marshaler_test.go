package middleware_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A message no envelope adapter decoded (no UUID: the subscriber's marshaler
// is Watermill's default, not the transport's adapter) is a wiring mistake
// that would dead-letter every message: the consumer holds it (a
// configuration error naming the adapter) and nacks it after MaxHold, so the
// broker keeps it until the subscriber is fixed; it is never dead-lettered
// and the handler never runs.
func TestMessageNoAdapterDecodedIsHeldNotDeadLettered(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	poison := &poisonLog{}
	cfg := e.config("stock")
	cfg.Poison.Publisher = poison
	cfg.Retry.MaxHold = 20 * time.Millisecond
	c, err := middleware.NewConsumer(cfg, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", countingHandler(&calls))
	require.NoError(t, err)

	msg := message.NewMessage("", []byte(`{"event_id":"01a240fc-ca50-762b-a37b-161eb27bc86f"}`))
	_, err = h(msg)
	require.Error(t, err, "nacked after the hold: the broker keeps it")
	require.True(t, middleware.IsConfiguration(err), "%v", err)
	require.ErrorContains(t, err, "amqp.Marshaler")
	require.Empty(t, poison.poisoned(), "a message no adapter decoded is never dead-lettered")
	require.Zero(t, calls.Load())
}
