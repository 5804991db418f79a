package inbox_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// countedMsg is a delivery the broker marks as redelivered: its attempt is
// counted (ConsumerConfig.MaxCrashes) when redelivered is true.
func countedMsg(redelivered bool) *message.Message {
	m := newMsg(uuid.Must(uuid.NewV7()).String())
	marshaler.SetRedelivered(m, redelivered)
	return m
}

// Counted attempts of one process run one at a time, whatever the
// consumer: a process that dies counts a crash for each counted attempt in
// flight, so a healthy redelivery handled beside the message that kills
// the process was dead-lettered with it. Here the first counted attempt's
// handler gives the second every chance to start (until it does, or a
// while); the second must not start before the first ended. The check
// cannot fail on a machine too slow to start the second in that while,
// only pass.
func TestCountedAttemptsOfOneProcessRunOneAtATime(t *testing.T) {
	e := newEnv(t)
	var inHandler, overlap atomic.Int32
	secondStarted := make(chan struct{})
	var once sync.Once
	first, second := countedMsg(true), countedMsg(true)
	firstIn := make(chan struct{}) // the first attempt is in its handler
	newH := func(consumer string) message.HandlerFunc {
		return e.mw(e.pool, func(c *inbox.Config) {
			c.Consumer = consumer
			c.MaxCrashes = 3
			c.CrashQuerier = sqldb.Pgx(e.pool)
		})(func(msg *message.Message) ([]*message.Message, error) {
			if inHandler.Add(1) > 1 {
				overlap.Add(1)
			}
			defer inHandler.Add(-1)
			if msg.UUID == first.UUID {
				close(firstIn)
				select {
				case <-secondStarted:
				case <-time.After(500 * time.Millisecond):
				}
			} else {
				once.Do(func() { close(secondStarted) })
			}
			return nil, writeEffect(msg, "")
		})
	}
	h1, h2 := newH("stock"), newH("billing") // two consumers of one process
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		_, err := h1(first)
		require.NoError(t, err)
	}()
	go func() {
		defer wg.Done()
		<-firstIn
		_, err := h2(second)
		require.NoError(t, err)
	}()
	wg.Wait()
	require.Zero(t, overlap.Load(), "two counted attempts of one process ran at once")
	require.Equal(t, 1, e.effects(first.UUID))
	require.Equal(t, 1, e.effects(second.UUID))
}

// A first delivery counts nothing and never waits for the counted attempt
// running in the process; and a counted attempt whose handler waits for
// another counted attempt of the process is not deadlocked: past the
// slot's bound the other runs beside it.
func TestCountedAttemptWaitsBoundedAndFirstDeliveriesNeverWait(t *testing.T) {
	defer inbox.SetCountedTurnWait(100 * time.Millisecond)()
	e := newEnv(t)
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = sqldb.Pgx(e.pool)
	})
	started := map[string]chan struct{}{}
	var mu sync.Mutex
	startedOf := func(id string) chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		if started[id] == nil {
			started[id] = make(chan struct{})
		}
		return started[id]
	}
	waiter, fresh, dependent := countedMsg(true), countedMsg(false), countedMsg(true)
	handler := h(func(msg *message.Message) ([]*message.Message, error) {
		close(startedOf(msg.UUID))
		if msg.UUID == waiter.UUID {
			for _, other := range []string{fresh.UUID, dependent.UUID} {
				select {
				case <-startedOf(other):
				case <-time.After(30 * time.Second):
					t.Errorf("deadlocked: %s never started while a counted attempt waited for it", other)
				}
			}
		}
		return nil, writeEffect(msg, "")
	})
	var wg sync.WaitGroup
	for _, m := range []*message.Message{waiter, fresh, dependent} {
		m := m
		wg.Add(1)
		go func() {
			defer wg.Done()
			if m != waiter {
				<-startedOf(waiter.UUID)
			}
			_, err := handler(m)
			require.NoError(t, err)
		}()
	}
	wg.Wait()
	for _, m := range []*message.Message{waiter, fresh, dependent} {
		require.Equal(t, 1, e.effects(m.UUID))
	}
}
