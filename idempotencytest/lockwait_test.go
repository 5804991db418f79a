package idempotencytest_test

import (
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// inFlightCounter counts the attempts that ended failed (the losing copies'
// claims that outwaited the lock timeout).
type inFlightCounter struct{ failed atomic.Int32 }

func (c *inFlightCounter) RecordOutcome(o middleware.Observation) {
	if o.Outcome == middleware.OutcomeFailed {
		c.failed.Add(1)
	}
}

// Copies that lose the race and wait on the claim longer than
// ConsumerConfig.LockTimeout fail that attempt with the transient
// ErrInFlight, and the consumer's chain holds them as it holds a router's
// delivery: re-run in place, they skip once the winner committed, and
// DeliverConcurrently reports nothing. Only a copy still held after
// Retry.MaxHold (or Subject.Timeout) returns its error, which is reported.
// The helper's doc says so.
func TestDeliverConcurrentlyHoldsCopiesThatOutwaitTheLockTimeout(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const handlerTakes, lockTimeout = 600 * time.Millisecond, 50 * time.Millisecond
	slow := func(c *middleware.Consumer) idempotencytest.Subject {
		s := f.subject(c)
		s.Handler = idempotencytest.NoPublish(func(msg *message.Message) error {
			time.Sleep(handlerTakes)
			return f.handler(msg)
		})
		return s
	}
	build := func(name string, maxHold time.Duration, rec middleware.Recorder) *middleware.Consumer {
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer: name, DB: f.db, LockTimeout: lockTimeout, Recorder: rec,
			Poison: middleware.PoisonConfig{Publisher: f.poison, Topic: "poison"},
			Retry:  middleware.RetryConfig{InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond, MaxHold: maxHold},
		}, nil)
		require.NoError(t, err)
		return c
	}

	t.Run("held until the winner committed", func(t *testing.T) {
		t.Parallel()
		rec := &inFlightCounter{}
		tb := &fakeTB{}
		r := idempotencytest.DeliverConcurrently(tb, slow(build("held", 0, rec)), newMsg(), 4)
		require.Empty(t, tb.all(), "nothing reported")
		require.Empty(t, r.Errors)
		require.Equal(t, 1, r.Calls)
		require.Equal(t, 1, r.Effects)
		require.GreaterOrEqual(t, rec.failed.Load(), int32(3), "each losing copy outwaited the lock timeout at least once")
	})

	t.Run("reported when still held after MaxHold", func(t *testing.T) {
		t.Parallel()
		tb := &fakeTB{}
		r := idempotencytest.DeliverConcurrently(tb, slow(build("short_hold", 2*lockTimeout, nil)), newMsg(), 2)
		require.Len(t, r.Errors, 1)
		require.ErrorIs(t, r.Errors[0], middleware.ErrInFlight)
		require.Contains(t, tb.all(), "in flight")
		require.Equal(t, 1, r.Effects, "the winner applied it")
	})

	t.Run("the doc says so", func(t *testing.T) {
		fset := token.NewFileSet()
		names, err := filepath.Glob("*.go")
		require.NoError(t, err)
		var files []*ast.File
		for _, name := range names {
			if strings.HasSuffix(name, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
			require.NoError(t, err)
			files = append(files, f)
		}
		p, err := doc.NewFromFiles(fset, files, "github.com/watermill-idempotency/idempotency/idempotencytest")
		require.NoError(t, err)
		var text string
		funcs := p.Funcs
		for _, typ := range p.Types { // a function returning Report is listed with it
			funcs = append(funcs, typ.Funcs...)
		}
		for _, fn := range funcs {
			if fn.Name == "DeliverConcurrently" {
				text = strings.Join(strings.Fields(fn.Doc), " ")
			}
		}
		require.Contains(t, text, "ConsumerConfig.LockTimeout")
		require.Contains(t, text, "the consumer's chain holds the copy")
		require.Contains(t, text, "Retry.MaxHold")
	})
}
