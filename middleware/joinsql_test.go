package middleware_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// A consumer with JoinSQLSubscriber on a subscriber that is not
// watermill-sql's holds the delivery (a configuration error, never
// poisoned, nothing applied) and says what to change in the API the user
// has: the field ConsumerConfig.JoinSQLSubscriber, not the library's
// internal beginners (inbox.NewPgxBeginner/NewStdBeginner), which no user
// can call.
func TestJoinSQLSubscriberWithoutSQLSubscriberNamesTheField(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	cfg := e.config("stock")
	cfg.JoinSQLSubscriber = true
	logs := &errorLog{}
	c, err := middleware.NewConsumer(cfg, logs)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	_, err = c.AddConsumerHandler(r, "reserve", "orders", e.pubsub, func(*message.Message) error { calls.Add(1); return nil })
	require.NoError(t, err)
	runRouter(t, r)
	require.NoError(t, e.pubsub.Publish("orders", newEvent(t)))

	var got error
	testenv.Eventually(t, 10*time.Second, "the configuration error logged at ERROR", func(o *testenv.Observed) bool {
		got = logs.first(middleware.IsConfiguration)
		return got != nil
	})
	require.Contains(t, got.Error(), "ConsumerConfig.JoinSQLSubscriber", "names the field to change")
	require.NotContains(t, got.Error(), "NewPgxBeginner", "names no internal function")
	require.Zero(t, calls.Load())
	require.Zero(t, e.effects(t))
}

// errorLog keeps the errors logged at ERROR (watermill's CaptureLoggerAdapter
// hands out its map unguarded, a race with the handler's goroutine).
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []error
}

func (l *errorLog) Error(_ string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, err)
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// first is the first logged error that match reports, or nil.
func (l *errorLog) first(match func(error) bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, err := range l.errs {
		if match(err) {
			return err
		}
	}
	return nil
}
