package amqp_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// A consumer that RabbitMQ cancels (basic.cancel: its queue deleted)
// dead-letters nothing: amqp091-go closes the delivery channel, and
// watermill-amqp v3 (subscriber.go ProcessMessages: `case amqpMsg :=
// <-amqpMsgs`, no ok check) hands the zero Delivery it reads there to the
// Marshaler, which must refuse it (errNoDelivery) rather than flag it
// malformed for the consumer to dead-letter as an empty phantom (which
// `idem dlq redrive` would publish to the queue). watermill-amqp then
// consumes again, on the queue it declares anew.
func TestBrokerCancelledConsumerDeadLettersNothingAndConsumesAgain(t *testing.T) {
	queue := testenv.UniqueName("cancelled_consumer")
	cfg := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
	cfg.Marshaler = idamqp.Marshaler{}
	cfg.Queue.GenerateName = wamqp.GenerateQueueNameConstant(queue)

	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_, _ = ch.QueueDelete(queue+".dlq", false, false, false)
	})

	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))

	logger := watermill.NopLogger{}
	sub, err := wamqp.NewSubscriber(cfg, logger)
	require.NoError(t, err)
	dl := idamqp.DeadLetterConfig{Subscriber: cfg, Topic: queue + ".dlq"}
	pubCfg, err := idamqp.DeclareDeadLetter(dl)
	require.NoError(t, err)
	poison, err := idamqp.NewConfirmedPublisher(pubCfg, logger)
	require.NoError(t, err)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "cancelled_consumer", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: dl.PoisonTopic()},
	}, logger)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	handled := make(chan string, 10)
	_, err = c.AddConsumerHandler(router, "cancelled_consumer", queue, sub, func(msg *message.Message) error {
		handled <- msg.UUID
		return nil
	})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-router.Running()

	e, err := marshaler.NewMessage("order.placed", map[string]int{"order_id": 1})
	require.NoError(t, err)
	publishConfirmed(t, queue, []*message.Message{e})
	select {
	case id := <-handled:
		require.Equal(t, e.UUID, id)
	case <-time.After(10 * time.Second):
		t.Fatal("event not handled")
	}

	// The operator deletes the (empty) queue: RabbitMQ sends basic.cancel.
	_, err = ch.QueueDelete(queue, false, false, false)
	require.NoError(t, err)
	// The subscriber consumes again (it declares the queue anew): once a
	// second event is handled, whatever the cancel made of the closed
	// channel's zero delivery has been handled and, had it been poisoned,
	// confirmed on the dead-letter queue.
	e2, err := marshaler.NewMessage("order.placed", map[string]int{"order_id": 2})
	require.NoError(t, err)
	deadline := time.After(60 * time.Second)
	for handledE2 := false; !handledE2; {
		if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
			// Not declared again yet: the passive declare closed the channel.
			ch, err = conn.Channel()
			require.NoError(t, err)
			select {
			case <-deadline:
				t.Fatal("the subscriber did not consume again after the cancel")
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		publishConfirmed(t, queue, []*message.Message{e2})
		select {
		case id := <-handled:
			require.Equal(t, e2.UUID, id)
			handledE2 = true
		case <-deadline:
			t.Fatal("the subscriber did not consume again after the cancel")
		}
	}

	var phantoms []amqp091.Delivery
	for {
		d, ok, err := ch.Get(queue+".dlq", true)
		require.NoError(t, err)
		if !ok {
			break
		}
		phantoms = append(phantoms, d)
	}
	for _, d := range phantoms {
		t.Logf("dead letter: body %q reason %q", d.Body, d.Headers["reason_poisoned"])
	}
	require.Empty(t, phantoms, "no producer published anything after the event: nothing may be dead-lettered")
}
