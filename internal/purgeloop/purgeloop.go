// Package purgeloop owns the background goroutine of the library's purgers
// (processed.Purger, versioned.FamilyPurger): run one purge every interval
// plus jitter until stopped, log what happened, and stop cleanly.
package purgeloop

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// RunFunc is one purge run: rows deleted, whether this instance held the
// lock, and an error.
type RunFunc func(ctx context.Context) (deleted int64, ran bool, err error)

// Loop runs a RunFunc periodically. The zero value is not usable: use New.
type Loop struct {
	run      RunFunc
	interval time.Duration
	jitter   time.Duration
	logger   watermill.LoggerAdapter
	fields   watermill.LogFields
	what     string

	mu      sync.Mutex
	cancel  context.CancelFunc
	stopped chan struct{}
}

// New returns a stopped loop; what names the purge in log lines ("processed
// events"), fields are added to them.
func New(run RunFunc, interval, jitter time.Duration, logger watermill.LoggerAdapter, what string, fields watermill.LogFields) *Loop {
	return &Loop{run: run, interval: interval, jitter: jitter, logger: logger, what: what, fields: fields}
}

// ErrStarted is returned by Start on a running loop.
var ErrStarted = errors.New("purger already started")

// Start runs the loop in a goroutine until Stop or ctx ends. Errors are
// logged and the loop goes on.
func (l *Loop) Start(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cancel != nil {
		return ErrStarted
	}
	ctx, l.cancel = context.WithCancel(ctx)
	l.stopped = make(chan struct{})
	go l.loop(ctx, l.stopped)
	return nil
}

// Stop ends the goroutine and waits for it (an ongoing run is cancelled
// through its context). Stop without Start is a no-op; a stopped loop can be
// started again.
func (l *Loop) Stop() {
	l.mu.Lock()
	cancel, stopped := l.cancel, l.stopped
	l.cancel = nil
	l.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-stopped
}

func (l *Loop) loop(ctx context.Context, stopped chan struct{}) {
	defer close(stopped)
	for {
		wait := l.interval
		if l.jitter > 0 {
			wait += rand.N(l.jitter)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		n, ran, err := l.run(ctx)
		f := l.fields.Add(watermill.LogFields{"deleted": n})
		switch {
		case err != nil && ctx.Err() == nil:
			l.logger.Error("Purge of "+l.what+" failed", err, f)
		case ran:
			l.logger.Debug("Purged "+l.what, f)
		}
	}
}

// Settings are the knobs every purger's public config shares; the configs
// convert to it so that defaults and validation are written once.
type Settings struct {
	Horizon, MinHorizon, Interval, Jitter time.Duration
	BatchSize                             int
}

// WithDefaults fills the zero fields: MinHorizon, Interval, BatchSize with
// the given defaults, Jitter with Interval/10.
func (s Settings) WithDefaults(minHorizon, interval time.Duration, batchSize int) Settings {
	if s.MinHorizon == 0 {
		s.MinHorizon = minHorizon
	}
	if s.Interval == 0 {
		s.Interval = interval
	}
	if s.Jitter == 0 {
		s.Jitter = s.Interval / 10
	}
	if s.BatchSize == 0 {
		s.BatchSize = batchSize
	}
	return s
}

// Validate reports the first invalid field as "<config>.<Field>: …"; a
// horizon below MinHorizon wraps tooShort.
func (s Settings) Validate(config string, tooShort error) error {
	switch {
	case s.Horizon <= 0:
		return fmt.Errorf("%s.Horizon is required (> 0)", config)
	case s.MinHorizon < 0:
		return fmt.Errorf("%s.MinHorizon %s: must be ≥ 0", config, s.MinHorizon)
	case s.Horizon < s.MinHorizon:
		return fmt.Errorf("%s.Horizon %s < MinHorizon %s: %w", config, s.Horizon, s.MinHorizon, tooShort)
	case s.Interval < 0, s.Jitter < 0:
		return fmt.Errorf("%s.Interval and Jitter must be ≥ 0", config)
	case s.BatchSize < 0:
		return fmt.Errorf("%s.BatchSize %d: must be > 0", config, s.BatchSize)
	}
	return nil
}
