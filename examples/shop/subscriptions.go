package shop

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Subscriptions returns sub as a subscriber whose Subscribe opens n
// subscriptions on sub (n ≥ 1) and merges their messages into one channel,
// closed once every subscription's is. A router handler on it handles up
// to n deliveries at once (the router runs each message in a goroutine of
// its own; each subscription waits for its delivery's ack), so one
// middleware.Consumer, which serves exactly one handler, gets n workers.
// Close closes sub. With n ≤ 1 it returns sub.
func Subscriptions(sub message.Subscriber, n int) message.Subscriber {
	if n <= 1 {
		return sub
	}
	return fanIn{sub: sub, n: n}
}

type fanIn struct {
	sub message.Subscriber
	n   int
}

func (f fanIn) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ctx, cancel := context.WithCancel(ctx)
	chans := make([]<-chan *message.Message, 0, f.n)
	for i := 0; i < f.n; i++ {
		ch, err := f.sub.Subscribe(ctx, topic)
		if err != nil {
			cancel() // ends the subscriptions already open
			return nil, err
		}
		chans = append(chans, ch)
	}
	out := make(chan *message.Message)
	var wg sync.WaitGroup
	for _, ch := range chans {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range ch {
				select {
				case out <- msg:
				case <-ctx.Done():
					msg.Nack() // the subscription ends: the broker redelivers it
				}
			}
		}()
	}
	go func() {
		wg.Wait()
		cancel()
		close(out)
	}()
	return out, nil
}

func (f fanIn) Close() error { return f.sub.Close() }
