package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// DefaultTimeout bounds all deliveries of one helper call, of each point
// for Explore (Subject.Timeout).
const DefaultTimeout = 30 * time.Second

// TB is the part of testing.TB the helpers use. *testing.T, *testing.B and
// *testing.F satisfy it.
type TB interface {
	Helper()
	Errorf(format string, args ...any)
}

// Subject is the handler under test and what surrounds it in production.
type Subject struct {
	// Handler is the user's handler, without middleware. The helpers count
	// how often it is entered. Required. NoPublish adapts a
	// message.NoPublishHandlerFunc.
	Handler message.HandlerFunc

	// Consumer is the consumer under test, built with middleware.NewConsumer
	// as in production and attached to no router: the helpers run Handler
	// inside its whole chain (poison, retry, recoverer, claim), attaching it
	// to a handler named "idempotencytest". Required.
	Consumer *middleware.Consumer

	// Effects counts the effect of msg as committed in the database, outside
	// any transaction, after all deliveries returned (for example
	// SELECT count(*) FROM reservation WHERE event_id = $1). Required.
	Effects func(ctx context.Context, msg *message.Message) (int, error)

	// WantEffects is what Effects must return after one processing. Defaults
	// to 1.
	WantEffects int

	// Timeout bounds all deliveries and the Effects call together; the
	// message contexts are cancelled after it. For Explore it bounds the
	// clean delivery, and each point's deliveries, apart. Defaults to
	// DefaultTimeout.
	Timeout time.Duration
}

// Report is what happened during one helper call.
type Report struct {
	// Deliveries is how many copies were delivered.
	Deliveries int
	// Calls is how many times Subject.Handler was entered.
	Calls int
	// Errors holds the non-nil results of deliveries, in no particular order
	// (for a router: the deliveries it would have nacked).
	Errors []error
	// Poisoned holds the reasons of the deliveries the consumer's chain
	// poisoned (published to the poison topic and acked: their result was
	// nil), in no particular order.
	Poisoned []string
	// Effects is what Subject.Effects returned after the deliveries (-1 when
	// it failed).
	Effects int
}

// NoPublish adapts a handler that produces no messages (what
// router.AddConsumerHandler takes) to Subject.Handler.
func NoPublish(h message.NoPublishHandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }
}

// DeliverTwice delivers msg, then a copy of it again (a broker redelivery
// after a lost ack), and checks through t that both deliveries returned nil
// (the duplicate is acknowledged, not failed) and none was poisoned, that
// the handler ran once and that Effects equals WantEffects. "Ran once"
// counts every entry: an attempt that failed and was retried in place is
// reported, since its effects outside the transaction (an external call)
// would happen again; Explore explores failures.
func DeliverTwice(t TB, s Subject, msg *message.Message) Report {
	t.Helper()
	return run(t, "DeliverTwice", s, msg, 2, false)
}

// DeliverConcurrently delivers n copies of msg at the same moment (n ≥ 2:
// several consumers each receiving it) and checks through t that every
// delivery returned nil and none was poisoned (each was applied or skipped
// as a duplicate), that the handler ran once and that Effects equals
// WantEffects. Each copy is marked as a first delivery (redelivered false,
// delivery count 0, as a transport that marks redeliveries marks one), so
// that the crash bound (ConsumerConfig.MaxCrashes) does not count the
// copies still waiting on the winner's claim as attempts that died.
//
// The copies that lose the race wait on the claim's primary key until the
// winner commits, then skip as duplicates. A copy whose wait outlasts
// middleware.ConsumerConfig.LockTimeout (a handler slower than it) fails
// that attempt with the transient middleware.ErrInFlight, and the
// consumer's chain holds the copy as it holds a router's delivery: the
// attempt is re-run in place, with the retry backoff, and skips once the
// winner committed, so nothing is reported. Only a copy still held after
// ConsumerConfig.Retry.MaxHold, or when Subject.Timeout ends, returns its
// error, which is reported.
func DeliverConcurrently(t TB, s Subject, msg *message.Message, n int) Report {
	t.Helper()
	if n < 2 {
		t.Errorf("idempotencytest.DeliverConcurrently: n = %d, want ≥ 2", n)
		return Report{}
	}
	return run(t, "DeliverConcurrently", s, msg, n, true)
}

func run(t TB, name string, s Subject, msg *message.Message, n int, concurrent bool) Report {
	t.Helper()
	switch {
	case s.Handler == nil:
		t.Errorf("idempotencytest.%s: Subject.Handler is nil", name)
		return Report{}
	case s.Consumer == nil:
		t.Errorf("idempotencytest.%s: Subject.Consumer is nil (build it with middleware.NewConsumer)", name)
		return Report{}
	case s.Effects == nil:
		t.Errorf("idempotencytest.%s: Subject.Effects is nil", name)
		return Report{}
	case msg == nil:
		t.Errorf("idempotencytest.%s: nil message", name)
		return Report{}
	}
	want := s.WantEffects
	if want == 0 {
		want = 1
	}
	timeout := s.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()

	var calls atomic.Int32
	h := message.HandlerFunc(func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return s.Handler(m)
	})
	h, err := door.Wrap(s.Consumer, "idempotencytest", h)
	if err != nil {
		t.Errorf("idempotencytest.%s: Subject.Consumer: %v", name, err)
		return Report{}
	}

	var (
		mu       sync.Mutex
		errs     []error
		poisoned []string
	)
	ctx = inbox.WithPoisonNotice(ctx, func(reason string) {
		mu.Lock()
		poisoned = append(poisoned, reason)
		mu.Unlock()
	})
	deliver := func() {
		c := msg.Copy()
		if concurrent {
			// Copies received at once by several consumers: first
			// deliveries, not redeliveries whose attempts the crash bound
			// counts (the ones waiting on the winner's claim would pass
			// MaxCrashes and be dead-lettered as crash_loop).
			marshaler.SetRedelivered(c, false)
			marshaler.SetDeliveryCount(c, 0)
		}
		c.SetContext(ctx)
		if err := safeCall(h, c); err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
	}
	if concurrent {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				deliver()
			}()
		}
		close(start)
		wg.Wait()
	} else {
		for i := 0; i < n; i++ {
			deliver()
		}
	}

	r := Report{Deliveries: n, Calls: int(calls.Load()), Errors: errs, Poisoned: poisoned, Effects: -1}
	for _, err := range errs {
		t.Errorf("idempotencytest.%s: a delivery of %s failed: %v", name, msg.UUID, err)
	}
	for _, reason := range poisoned {
		t.Errorf("idempotencytest.%s: a delivery of %s was poisoned (dead-lettered) instead of applied or skipped as a duplicate: %s",
			name, msg.UUID, reason)
	}
	if r.Calls != 1 {
		t.Errorf("idempotencytest.%s: handler entered %d times for %d deliveries of %s, want 1 "+
			"(a duplicate is never entered; an attempt that failed and was retried in place is)",
			name, r.Calls, n, msg.UUID)
	}
	got, err := s.Effects(ctx, msg)
	if err != nil {
		t.Errorf("idempotencytest.%s: Effects: %v", name, err)
		return r
	}
	r.Effects = got
	if got != want {
		t.Errorf("idempotencytest.%s: %d effects after %d deliveries of %s, want %d", name, got, n, msg.UUID, want)
	}
	return r
}

// safeCall runs h, turning a panic that escaped the middleware into an error,
// so that one bad delivery does not kill the test binary from a goroutine.
func safeCall(h message.HandlerFunc, msg *message.Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	_, err = h(msg)
	return err
}

// Deliver runs one delivery of msg through Subject.Consumer's whole chain,
// as a router would, and returns what the chain returns: the messages the
// router would publish, and the error it would nack with (nil: acked,
// including a message sent to the poison topic). Subject.Effects and
// WantEffects are not used.
func Deliver(s Subject, msg *message.Message) ([]*message.Message, error) {
	if s.Handler == nil || s.Consumer == nil || msg == nil {
		return nil, errors.New("idempotencytest.Deliver: Subject.Handler, Subject.Consumer and the message are required")
	}
	h, err := door.Wrap(s.Consumer, "idempotencytest", s.Handler)
	if err != nil {
		return nil, fmt.Errorf("idempotencytest.Deliver: Subject.Consumer: %w", err)
	}
	timeout := s.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c := msg.Copy()
	c.SetContext(ctx)
	return h(c)
}
