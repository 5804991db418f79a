package middleware

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Chain defaults (ChainConfig).
const (
	DefaultMaxRetries      = 5
	DefaultInitialInterval = 100 * time.Millisecond
	DefaultMaxInterval     = 10 * time.Second
	DefaultMultiplier      = 2.0
)

// ChainConfig configures NewChain: the recommended middleware chain around
// the idempotent middleware.
type ChainConfig struct {
	// Idempotent is the innermost middleware. Required.
	Idempotent *Idempotent

	// PoisonPublisher and PoisonTopic receive messages that cannot be
	// processed: permanent errors at once, other handler errors once retries
	// are exhausted. Infrastructure (transient) errors never go there. Both
	// required. Watermill's PoisonQueue adds the reason in metadata
	// ("reason_poisoned") and the message is then acked.
	PoisonPublisher message.Publisher
	PoisonTopic     string

	// AfterPoison are extra middlewares placed just inside the poison
	// middleware and outside Retry, outermost first: the place for routers
	// that take some permanent errors elsewhere before the poison topic sees
	// them (operation.RouteUncertain sends uncertain external outcomes to a
	// reconciliation topic). Defaults to none.
	AfterPoison []message.HandlerMiddleware

	// MaxRetries is how many times Watermill's Retry re-runs a failing
	// attempt in-process before giving up on it. Defaults to DefaultMaxRetries.
	MaxRetries int
	// InitialInterval, MaxInterval and Multiplier shape the exponential
	// backoff between retries. Default to DefaultInitialInterval,
	// DefaultMaxInterval, DefaultMultiplier.
	InitialInterval time.Duration
	MaxInterval     time.Duration
	Multiplier      float64
}

func (c *ChainConfig) setDefaults() {
	if c.MaxRetries == 0 {
		c.MaxRetries = DefaultMaxRetries
	}
	if c.InitialInterval == 0 {
		c.InitialInterval = DefaultInitialInterval
	}
	if c.MaxInterval == 0 {
		c.MaxInterval = DefaultMaxInterval
	}
	if c.Multiplier == 0 {
		c.Multiplier = DefaultMultiplier
	}
}

// Validate reports the first invalid field of c, naming it.
func (c ChainConfig) Validate() error {
	switch {
	case c.Idempotent == nil:
		return errors.New("middleware: ChainConfig.Idempotent is required")
	case c.PoisonPublisher == nil:
		return errors.New("middleware: ChainConfig.PoisonPublisher is required")
	case c.PoisonTopic == "":
		return errors.New("middleware: ChainConfig.PoisonTopic is required")
	case c.MaxRetries < 0:
		return fmt.Errorf("middleware: ChainConfig.MaxRetries %d: must be ≥ 0", c.MaxRetries)
	case c.Multiplier != 0 && c.Multiplier < 1:
		return fmt.Errorf("middleware: ChainConfig.Multiplier %v: must be ≥ 1", c.Multiplier)
	}
	return nil
}

// NewChain returns the recommended chain, outermost first, to pass to
// router.AddMiddleware(chain...) (Watermill runs the first added outermost):
//
//  1. PoisonQueue with a filter (then ChainConfig.AfterPoison, if any): a permanent error (IsPermanent) or any
//     non-transient error that survived the retries is published to
//     PoisonTopic with its reason and the message is acked, once. A transient
//     (infrastructure) error is returned to the router, which nacks: the
//     broker redelivers and the message waits, unacked, until the database
//     is back.
//  2. Retry with ResetContextOnRetry (Watermill issue #467) and ShouldRetry
//     false for permanent errors, so they are not retried.
//  3. Recoverer: a handler panic becomes an error (after the idempotent
//     middleware rolled back).
//  4. The idempotent middleware: each attempt in a fresh transaction.
//
// Putting Retry inside the transaction, or PoisonQueue inside Retry, breaks
// these guarantees; this constructor exists so that the order is not the
// caller's to get wrong.
func NewChain(cfg ChainConfig, logger watermill.LoggerAdapter) ([]message.HandlerMiddleware, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	poison, err := wmw.PoisonQueueWithFilter(cfg.PoisonPublisher, cfg.PoisonTopic, ShouldPoison)
	if err != nil {
		return nil, err
	}
	initial, multiplier := compensatedBackoff(cfg.InitialInterval, cfg.Multiplier)
	retry := wmw.Retry{
		MaxRetries:          cfg.MaxRetries,
		InitialInterval:     initial,
		MaxInterval:         cfg.MaxInterval,
		Multiplier:          multiplier,
		RandomizationFactor: 0.2,
		ResetContextOnRetry: true,
		ShouldRetry:         func(p wmw.RetryParams) bool { return !IsPermanent(p.Err) },
		Logger:              logger,
	}
	chain := []message.HandlerMiddleware{poison}
	chain = append(chain, cfg.AfterPoison...)
	return append(chain, retry.Middleware, wmw.Recoverer, cfg.Idempotent.Middleware), nil
}

// compensatedBackoff returns the InitialInterval and Multiplier to give
// Watermill's Retry so that the waits it actually makes are initial,
// initial·m, initial·m², … In Watermill v1.5.1 (message/router/middleware/
// retry.go) a ShouldRetry function is passed RetryParams.Delay computed with
// one more NextBackOff() call, so the exponential backoff advances twice per
// failure and the k-th wait is I'·m'^(2k−1). With m' = √m and I' = I/√m that
// is I·m^(k−1), the schedule ChainConfig documents.
func compensatedBackoff(initial time.Duration, m float64) (time.Duration, float64) {
	root := math.Sqrt(m)
	return time.Duration(float64(initial) / root), root
}

// ShouldPoison is the chain's poison filter: true for every error except a
// transient (infrastructure) one, which must leave the message unacked on the
// broker rather than on the poison topic.
func ShouldPoison(err error) bool {
	return err != nil && !IsTransient(err)
}
