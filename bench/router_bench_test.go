package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// BenchmarkRouterOneWorker is the one-worker profile harness: one message
// at a time through a Watermill router (gochannel, each Publish blocks until
// the handler acked), the one-INSERT handler, under
//
//   - plain: the handler in a plain pgx transaction (pool.Begin, Commit),
//     no chain: what a router without this library runs;
//   - consumer: middleware.NewConsumer with its recommended defaults (whole
//     chain, payload verification, lock timeout, crash bound) and
//     AddConsumerHandler, new events;
//   - duplicate: the same consumer fed events it already processed.
//
// allocs/op is the figure to read (load does not move it); ns/op moves
// with the machine's load. For attribution:
//
//	go test -run '^$' -bench RouterOneWorker -cpu 1 -benchtime 5000x \
//	    -cpuprofile cpu.out -trace trace.out ./bench/
//
// and under cachegrind (instructions, load-independent): the test binary
// (go test -c) run twice with -test.benchtime at two counts, the difference
// divided by the difference of counts (bench/counts.go explains why).
func BenchmarkRouterOneWorker(b *testing.B) {
	ctx := context.Background()
	vs, dups := benchSetup(b, 2)
	for _, v := range []string{vNone, vOurs, vDuplicate} {
		name := map[string]string{vNone: "plain", vOurs: "consumer", vDuplicate: "duplicate"}[v]
		b.Run(name, func(b *testing.B) {
			msgs := make([]*message.Message, b.N)
			for i := range msgs {
				var err error
				if v == vDuplicate {
					msgs[i], err = marshaler.NewMessageWithID(dups[i%len(dups)], eventName, time.Now().UTC(), payload())
				} else {
					msgs[i], err = newV7()
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			pub := routerOneWorker(ctx, b, vs, v)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := pub.Publish("orders", msgs[i]); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
		})
	}
}

// routerOneWorker starts a router whose one handler consumes "orders" from
// a blocking gochannel under variant v (none, idempotent or duplicate), and
// returns the publisher; the router stops with b.
func routerOneWorker(ctx context.Context, b *testing.B, vs *variantSet, v string) message.Publisher {
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		b.Fatal(err)
	}
	failed := make(chan error, 1)
	fail := func(err error) error {
		select {
		case failed <- err:
		default:
		}
		return err
	}
	h := handler(h1)
	if v == vNone {
		plain := txMiddleware(vs.pool)(h)
		r.AddConsumerHandler("bench_router", "orders", ps, func(msg *message.Message) error {
			_, err := plain(msg)
			if err != nil {
				return fail(err)
			}
			return nil
		})
	} else {
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer:      consumerName,
			DB:            idempotency.Pgx(vs.pool),
			Table:         vs.store.Table().String(),
			ReplayHorizon: vs.store.Horizon(),
			Poison:        middleware.PoisonConfig{Publisher: poisonFails{fail}, Topic: "bench_poison"},
		}, logger)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.AddConsumerHandler(r, "bench_router", "orders", ps, func(msg *message.Message) error {
			_, err := h(msg)
			return err
		}); err != nil {
			b.Fatal(err)
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	<-r.Running()
	b.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
		_ = ps.Close()
		select {
		case err := <-failed:
			b.Errorf("a message failed: %v", err)
		default:
		}
	})
	return ps
}

// poisonFails is the benchmark consumer's poison publisher: nothing may be
// poisoned, so a publish reports the failure and succeeds (the delivery is
// acked and the benchmark fails at its end).
type poisonFails struct{ fail func(error) error }

func (p poisonFails) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		_ = p.fail(fmt.Errorf("poisoned: %s", m.Metadata.Get("reason_poisoned")))
	}
	return nil
}
func (poisonFails) Close() error { return nil }
