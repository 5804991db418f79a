package billing

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// Errors of the fake provider, as a real provider's client would map its
// answers.
var (
	// ErrTimeout: the request was sent and the answer never came. The charge
	// may have been made (with InjectTimeouts, it was).
	ErrTimeout = errors.New("billing: payment provider timed out (the charge may have been made)")
	// ErrDeclined: the provider refused the charge; nothing was charged.
	ErrDeclined = errors.New("billing: payment declined")
	// ErrKeyReused: the provider knows the idempotency key with another
	// amount or currency; nothing was charged. (Providers such as Stripe
	// answer this; our fingerprint check refuses such a request first.)
	ErrKeyReused = errors.New("billing: idempotency key reused with other parameters")
)

// Charge is one charge made by the provider.
type Charge struct {
	// ID is the provider's reference, "ch_1", "ch_2", … in creation order.
	ID string `json:"id"`
	// Key is the idempotency key the charge was made with.
	Key string `json:"key"`
	// AmountMinor is the amount in minor units (cents).
	AmountMinor int64 `json:"amount_minor"`
	// Currency is the ISO 4217 code.
	Currency string `json:"currency"`
}

// Provider is a fake payment provider, in memory, that honours idempotency
// keys the way card processors do: a charge request with a key it has seen,
// with the same amount and currency, returns the existing charge and charges
// nothing; with another amount or currency it is refused (ErrKeyReused). It
// can be asked for a charge by key (Lookup), and made to time out after
// charging (InjectTimeouts). Safe for concurrent use.
type Provider struct {
	mu           sync.Mutex
	byKey        map[string]Charge
	calls        int
	lookups      int
	timeoutEvery int
	made         int
}

// NewProvider returns a provider with no charges and no injected faults.
func NewProvider() *Provider { return &Provider{byKey: map[string]Charge{}} }

// InjectTimeouts makes every n-th new charge (the n-th, 2n-th, … charge
// made) time out after it was made: the charge exists, the caller gets
// ErrTimeout. 0 (the default) turns it off; a negative n is taken as 0.
func (p *Provider) InjectTimeouts(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.timeoutEvery = max(n, 0)
}

// Charge charges amountMinor of currency under the idempotency key. An
// amount ≤ 0 is declined (ErrDeclined). A known key returns its charge
// (same parameters) or ErrKeyReused (other parameters), charging nothing.
// ctx is only checked on entry: a fake answers at once.
func (p *Provider) Charge(ctx context.Context, key string, amountMinor int64, currency string) (Charge, error) {
	if err := ctx.Err(); err != nil {
		return Charge{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if c, ok := p.byKey[key]; ok {
		if c.AmountMinor != amountMinor || c.Currency != currency {
			return Charge{}, fmt.Errorf("%w: key %s", ErrKeyReused, key)
		}
		return c, nil
	}
	if amountMinor <= 0 {
		return Charge{}, fmt.Errorf("%w: amount %d", ErrDeclined, amountMinor)
	}
	p.made++
	c := Charge{ID: fmt.Sprintf("ch_%d", p.made), Key: key, AmountMinor: amountMinor, Currency: currency}
	p.byKey[key] = c
	if p.timeoutEvery > 0 && p.made%p.timeoutEvery == 0 {
		return Charge{}, ErrTimeout
	}
	return c, nil
}

// Lookup returns the charge made with key, if any.
func (p *Provider) Lookup(ctx context.Context, key string) (Charge, bool, error) {
	if err := ctx.Err(); err != nil {
		return Charge{}, false, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lookups++
	c, ok := p.byKey[key]
	return c, ok, nil
}

// Charges is the number of charges made: what the customer was billed for.
func (p *Provider) Charges() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.byKey)
}

// Calls is the number of Charge requests received, deduplicated or not.
func (p *Provider) Calls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

// Lookups is the number of Lookup requests received.
func (p *Provider) Lookups() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lookups
}
