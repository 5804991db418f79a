package operation_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// Event ids of case C14 (payments; valid UUIDv7).
const (
	idE5 = "01906dbc-ad04-70e5-8e5f-6a7b8c9d0e1f"
	idE6 = "01906dbc-ad05-70f6-9f6a-7b8c9d0e1f2a"
)

// paymentRequested is the payload of the C14 payment.requested event.
type paymentRequested struct {
	PaymentID string      `json:"payment_id"`
	Amount    json.Number `json:"amount"`
	Currency  string      `json:"currency"`
	AttemptTS string      `json:"attempt_ts"`
}

// chargeHandler is the C14 handler: the key is charge:<payment_id>, the
// fingerprinted parameters are {amount, currency}, never attempt_ts.
func chargeHandler(r *operation.Runner, call func(amount, currency string) operation.CallFunc, opts ...operation.Option) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		var ev paymentRequested
		dec := json.NewDecoder(bytes.NewReader(msg.Payload))
		dec.UseNumber()
		if err := dec.Decode(&ev); err != nil {
			return nil, inbox.Permanent(err)
		}
		key, err := operation.NewKey("charge", ev.PaymentID)
		if err != nil {
			return nil, inbox.Permanent(err)
		}
		params := map[string]any{"amount": ev.Amount, "currency": ev.Currency}
		_, err = r.Do(msg.Context(), key, params, call(ev.Amount.String(), ev.Currency), opts...)
		return nil, err
	}
}

// topics collects what the chain publishes to the poison and reconciliation
// topics of a gochannel pubsub. Publish blocks until the collector acked, so
// once the chain returned, everything it published is counted.
type topics struct {
	mu     sync.Mutex
	poison []*message.Message
	recon  []*message.Message
}

func (tp *topics) counts() (poison, recon int) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return len(tp.poison), len(tp.recon)
}

func (tp *topics) lastRecon() *message.Message {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return tp.recon[len(tp.recon)-1]
}

// newChain wraps h as the recommended chain does, outermost first: poison
// (inbox.ShouldPoison) → RouteUncertain → Retry (not for permanent
// errors) → h. The idempotent middleware is left out: its transaction plays
// no part in what is tested here.
func newChain(t *testing.T, h message.HandlerFunc, retries int) (message.HandlerFunc, *topics) {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = pubsub.Close() })
	tp := &topics{}
	for _, topic := range []string{"poison", "reconcile"} {
		ch, err := pubsub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		go func() {
			for m := range ch {
				tp.mu.Lock()
				if topic == "poison" {
					tp.poison = append(tp.poison, m)
				} else {
					tp.recon = append(tp.recon, m)
				}
				tp.mu.Unlock()
				m.Ack()
			}
		}()
	}
	poison, err := wmw.PoisonQueueWithFilter(pubsub, "poison", inbox.ShouldPoison)
	require.NoError(t, err)
	route, err := operation.RouteUncertain(pubsub, "reconcile", nil)
	require.NoError(t, err)
	retry := wmw.Retry{
		MaxRetries:      retries,
		InitialInterval: time.Millisecond,
		ShouldRetry:     func(p wmw.RetryParams) bool { return !inbox.IsPermanent(p.Err) },
	}
	return poison(route(retry.Middleware(h))), tp
}

func paymentMsg(t *testing.T, id, paymentID, amount, ts string) *message.Message {
	t.Helper()
	body := `{"payment_id":"` + paymentID + `","amount":` + amount + `,"currency":"EUR","attempt_ts":"` + ts + `"}`
	return message.NewMessage(id, []byte(body))
}

// TestOperationKeyChargesOnceAcrossTimeoutsAndWorkers (case C14): payments
// through operation keys: a timeout after the charge is reconciled by key, a
// reused key with other parameters is a conflict, two workers charge once.
func TestOperationKeyChargesOnceAcrossTimeoutsAndWorkers(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		// No in-process retry: each call of chain is one delivery.
		chain, tp := newChain(t, chargeHandler(r, p.call, operation.WithReconcile(p.reconcile)), 0)
		keyP1 := mustKey(t, "charge", "p-1")

		t.Run("E5 times out after charging, the next attempt reconciles by key: one charge", func(t *testing.T) {
			p.mu.Lock()
			p.timeouts = 1
			p.mu.Unlock()

			_, err := chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:00:00.000Z"))
			require.ErrorIs(t, err, operation.ErrUncertain)
			require.True(t, inbox.IsTransient(err), "with a reconcile function, uncertain is retried")
			require.False(t, inbox.IsPermanent(err))
			rec, err := r.Get(ctx, keyP1)
			require.NoError(t, err)
			require.Equal(t, operation.StateUncertain, rec.State)

			// Attempt 2: the same path (a redelivery; attempt_ts differs).
			_, err = chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:00:05.000Z"))
			require.NoError(t, err)

			charges, calls, lookups := p.counts()
			require.Equal(t, 1, charges, "one charge")
			require.Equal(t, 1, calls, "never a blind re-call")
			require.Equal(t, 1, lookups)
			require.Equal(t, []string{"charge charge:p-1", "lookup charge:p-1"}, p.seenKeys(), "the provider sees the same key both times")
			rec, err = r.Get(ctx, keyP1)
			require.NoError(t, err)
			require.Equal(t, operation.StateSucceeded, rec.State)
			require.Equal(t, "ch_1", rec.Reference)
			require.Equal(t, 2, rec.Attempts)

			// A third delivery replays the recorded result: nothing is called.
			_, err = chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:01:00.000Z"))
			require.NoError(t, err)
			require.Len(t, p.seenKeys(), 2)
			poison, recon := tp.counts()
			require.Zero(t, poison)
			require.Zero(t, recon)
		})

		t.Run("the fingerprint does not depend on key order, spacing or number spelling", func(t *testing.T) {
			a, err := operation.Fingerprint(map[string]any{"amount": 100, "currency": "EUR"})
			require.NoError(t, err)
			b, err := operation.Fingerprint(json.RawMessage(`{ "currency" : "EUR",
				"amount" : 1.00e2 }`))
			require.NoError(t, err)
			require.Equal(t, a, b)

			res, err := r.Do(ctx, keyP1, json.RawMessage(`{"currency":"EUR","amount":100.0}`), p.call("100.0", "EUR"))
			require.NoError(t, err)
			require.Equal(t, operation.OriginStored, res.Origin)
			require.Equal(t, "ch_1", res.Reference)
			require.Len(t, p.seenKeys(), 2, "no call")
		})

		t.Run("E6 reuses charge:p-1 for 200: typed mismatch before any call, DLQ as permanent", func(t *testing.T) {
			_, err := r.Do(ctx, keyP1, map[string]any{"amount": 200, "currency": "EUR"}, p.call("200", "EUR"))
			var conflict *operation.ConflictError
			require.ErrorAs(t, err, &conflict)
			require.ErrorIs(t, err, operation.ErrConflict)
			require.Equal(t, "charge:p-1", conflict.Key)
			require.Equal(t, operation.StateSucceeded, conflict.State)
			require.True(t, inbox.IsPermanent(err))
			require.False(t, inbox.IsTransient(err))

			_, err = chain(paymentMsg(t, idE6, "p-1", "200", "2024-07-01T10:02:00.000Z"))
			require.NoError(t, err, "poisoned and acked")
			poison, recon := tp.counts()
			require.Equal(t, 1, poison)
			require.Zero(t, recon)
			tp.mu.Lock()
			require.Equal(t, idE6, tp.poison[0].UUID)
			require.Contains(t, tp.poison[0].Metadata.Get(wmw.ReasonForPoisonedKey), "other parameters")
			tp.mu.Unlock()
			require.Len(t, p.seenKeys(), 2, "the provider was not called")
		})

		t.Run("two workers claim charge:p-2 at once: one call, the other waits and gets the result", func(t *testing.T) {
			p2 := newProvider()
			p2.entered = make(chan string, 2)
			p2.block = make(chan struct{})
			unblock := sync.OnceFunc(func() { close(p2.block) })
			t.Cleanup(unblock) // a failing test must not leave workers (and pool connections) blocked
			key := mustKey(t, "charge", "p-2")
			type outcome struct {
				res operation.Result
				err error
			}
			results := make(chan outcome, 2)
			for range 2 {
				go func() {
					res, err := r.Do(ctx, key, map[string]any{"amount": 100, "currency": "EUR"}, p2.call("100", "EUR"))
					results <- outcome{res, err}
				}()
			}
			select {
			case <-p2.entered:
			case <-time.After(10 * time.Second):
				t.Fatal("no worker reached the provider")
			}
			eventually(t, "the second worker waiting for the key", func(o *testenv.Observed) bool { return o.Int("lock waiters", e.lockWaiters(t, key)) == 1 })
			unblock()
			origins := map[operation.Origin]int{}
			for range 2 {
				o := <-results
				require.NoError(t, o.err)
				require.Equal(t, "ch_1", o.res.Reference)
				origins[o.res.Origin]++
			}
			require.Equal(t, map[operation.Origin]int{operation.OriginCall: 1, operation.OriginStored: 1}, origins)
			charges, calls, _ := p2.counts()
			require.Equal(t, 1, charges)
			require.Equal(t, 1, calls)
		})

		t.Run("the other caller may instead get a retryable in-progress error", func(t *testing.T) {
			p3 := newProvider()
			p3.entered = make(chan string, 1)
			p3.block = make(chan struct{})
			unblock := sync.OnceFunc(func() { close(p3.block) })
			t.Cleanup(unblock)
			key := mustKey(t, "charge", "p-3")
			params := map[string]any{"amount": 100, "currency": "EUR"}
			done := make(chan error, 1)
			go func() {
				_, err := r.Do(ctx, key, params, p3.call("100", "EUR"))
				done <- err
			}()
			select {
			case <-p3.entered:
			case <-time.After(10 * time.Second):
				t.Fatal("the first worker did not reach the provider")
			}
			for _, wait := range []time.Duration{-1, 20 * time.Millisecond} {
				_, err := r.Do(ctx, key, params, p3.call("100", "EUR"), operation.WithWait(wait))
				var inProgress *operation.InProgressError
				require.ErrorAs(t, err, &inProgress, "wait %s", wait)
				require.ErrorIs(t, err, operation.ErrInProgress)
				require.True(t, inbox.IsTransient(err))
				require.False(t, inbox.IsPermanent(err))
			}
			// Held by a live worker, yet another request with the key is
			// refused at once as a conflict, not made to wait.
			_, err := r.Do(ctx, key, map[string]any{"amount": 999, "currency": "EUR"}, p3.call("999", "EUR"))
			require.ErrorIs(t, err, operation.ErrConflict)
			unblock()
			require.NoError(t, <-done)
			_, calls, _ := p3.counts()
			require.Equal(t, 1, calls)
		})
	})
}

// A timeout with no reconcile function: the message goes to the
// reconciliation topic once per delivery, with the key; the provider is
// called once, and never again until the operation is resolved.
func TestTimeoutRoutesToReconciliationTopic(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		p := newProvider()
		p.timeouts = 1
		// Retry would re-run the attempt up to 3 times if the error allowed it.
		chain, tp := newChain(t, chargeHandler(r, p.call), 3)
		key := mustKey(t, "charge", "p-1")

		_, err := chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:00:00.000Z"))
		require.NoError(t, err, "routed and acked")
		poison, recon := tp.counts()
		require.Zero(t, poison)
		require.Equal(t, 1, recon)
		m := tp.lastRecon()
		require.Equal(t, idE5, m.UUID)
		require.Equal(t, "charge:p-1", m.Metadata.Get(operation.MetadataKey))
		require.Equal(t, "charge", m.Metadata.Get(operation.MetadataKind))
		require.Equal(t, "1", m.Metadata.Get(operation.MetadataAttempts))
		require.Contains(t, m.Metadata.Get(operation.MetadataReason), errTimeout.Error())
		parsed, err := operation.ParseKey(m.Metadata.Get(operation.MetadataKey))
		require.NoError(t, err)
		require.Equal(t, key, parsed)
		charges, calls, _ := p.counts()
		require.Equal(t, 1, charges)
		require.Equal(t, 1, calls)
		rec, err := r.Get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, operation.StateUncertain, rec.State)

		// The error itself, as a handler sees it.
		_, err = r.Do(ctx, key, map[string]any{"amount": 100, "currency": "EUR"}, p.call("100", "EUR"))
		var u *operation.UncertainError
		require.ErrorAs(t, err, &u)
		require.Equal(t, "charge:p-1", u.Key)
		require.False(t, u.Retry)
		require.True(t, inbox.IsPermanent(err))
		require.True(t, operation.NeedsReconciliation(err))

		// A redelivery before anyone resolved it: routed again, not called.
		_, err = chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:00:00.000Z"))
		require.NoError(t, err)
		_, recon = tp.counts()
		require.Equal(t, 2, recon)
		_, calls, _ = p.counts()
		require.Equal(t, 1, calls)

		// The reconciliation side looks the key up and resolves it; a replay of
		// the event then completes with the recorded result.
		c, ok := p.Lookup(ctx, parsed.String())
		require.True(t, ok)
		require.NoError(t, r.Resolve(ctx, parsed, operation.VerdictSucceeded(operation.Result{Reference: c.ID})))
		_, err = chain(paymentMsg(t, idE5, "p-1", "100", "2024-07-01T10:00:00.000Z"))
		require.NoError(t, err)
		poison, recon = tp.counts()
		require.Zero(t, poison)
		require.Equal(t, 2, recon)
		_, calls, _ = p.counts()
		require.Equal(t, 1, calls)
		rec, err = r.Get(ctx, key)
		require.NoError(t, err)
		require.Equal(t, operation.StateSucceeded, rec.State)
		require.Equal(t, "ch_1", rec.Reference)
	})
}

// A failed publish to the reconciliation topic leaves the message for a
// redelivery (transient), never for the poison topic.
func TestRouteUncertainPublishFailure(t *testing.T) {
	t.Parallel()
	route, err := operation.RouteUncertain(failingPublisher{}, "reconcile", nil)
	require.NoError(t, err)
	uncertain := &operation.UncertainError{Key: "charge:p-1", Kind: "charge"}
	_, err = route(func(*message.Message) ([]*message.Message, error) { return nil, uncertain })(message.NewMessage(idE5, nil))
	require.True(t, inbox.IsTransient(err))
	require.False(t, inbox.IsPermanent(err))
	require.False(t, inbox.ShouldPoison(err))

	// Retryable uncertainty and other errors pass through untouched.
	retry := &operation.UncertainError{Key: "charge:p-1", Retry: true}
	_, err = route(func(*message.Message) ([]*message.Message, error) { return nil, retry })(message.NewMessage(idE5, nil))
	require.Same(t, retry, err)
	other := errors.New("x")
	_, err = route(func(*message.Message) ([]*message.Message, error) { return nil, other })(message.NewMessage(idE5, nil))
	require.Same(t, other, err)

	_, err = operation.RouteUncertain(nil, "t", nil)
	require.Error(t, err)
	_, err = operation.RouteUncertain(failingPublisher{}, "", nil)
	require.Error(t, err)
}

type failingPublisher struct{}

func (failingPublisher) Publish(string, ...*message.Message) error { return errors.New("broker down") }
func (failingPublisher) Close() error                              { return nil }
