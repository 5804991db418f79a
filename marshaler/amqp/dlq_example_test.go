package amqp_test

import (
	"os"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	idamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
)

// The poison queue of a consumer built with watermill-amqp's topic layout:
// DeclareDeadLetter declares "stock.events.dlq" (quorum) behind an exchange
// of its own and returns the publisher configuration that routes there;
// the chain publishes poisoned messages with it. Needs a broker (not run).
func ExampleDeclareDeadLetter() {
	logger := watermill.NewStdLogger(false, false)
	sub := wamqp.NewDurableTopicConfig(os.Getenv("AMQP_URL"), "events", "stock.events")
	sub.Exchange.Durable = true
	sub.Marshaler = idamqp.Marshaler{}

	dl := idamqp.DeadLetterConfig{Subscriber: sub, Topic: "stock.events.dlq", Quorum: true}
	pubCfg, err := idamqp.DeclareDeadLetter(dl)
	if err != nil {
		panic(err)
	}
	poison, err := idamqp.NewConfirmedPublisher(pubCfg, logger)
	if err != nil {
		panic(err)
	}
	defer poison.Close()
	_ = inbox.ChainConfig{PoisonPublisher: poison, PoisonTopic: dl.PoisonTopic()} // with Idempotent, to NewHandlerMiddleware
}
