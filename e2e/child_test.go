package e2e_test

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Child roles, run by the re-executed test binary (TestMain):
//
//	consumer  the test consumer on E2E_SCHEMA (of the server at
//	          DATABASE_URL) / E2E_PREFIX, SIGKILLed when the middleware
//	          reaches crash point E2E_CRASH; E2E_LC sets the sessions'
//	          lc_messages.
//	relay     the order relay on E2E_SCHEMA publishing to E2E_PREFIX's
//	          exchange, SIGKILLed right after its first publish was confirmed
//	          by the broker, before it stores its position.
//
// A child that does not die within 30 s exits with status 3.
func runChild(role string) int {
	var err error
	switch role {
	case "consumer":
		err = childConsumer()
	case "relay":
		err = childRelay()
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	<-time.After(30 * time.Second)
	fmt.Fprintln(os.Stderr, "child: crash point not reached")
	return 3
}

func killSelf() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) }

func childPool(lc string) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return nil, err
	}
	pc.ConnConfig.RuntimeParams["search_path"] = os.Getenv("E2E_SCHEMA")
	if lc != "" {
		pc.ConnConfig.RuntimeParams["lc_messages"] = lc
	}
	pc.MaxConns = 4
	return pgxpool.NewWithConfig(context.Background(), pc)
}

func childConsumer() error {
	pool, err := childPool(os.Getenv("E2E_LC"))
	if err != nil {
		return err
	}
	crash := os.Getenv("E2E_CRASH")
	crashpoint.Set(func(name string) {
		if name == crash {
			killSelf()
		}
	})
	topo := shop.Topology{Prefix: os.Getenv("E2E_PREFIX"), Prefetch: 4}
	svc, err := newService(pool, topo, testConsumer, consumerOpts{logger: watermill.NewStdLogger(false, false)})
	if err != nil {
		return err
	}
	go func() { _ = svc.Run(context.Background()) }()
	return nil
}

func childRelay() error {
	pool, err := childPool("")
	if err != nil {
		return err
	}
	topo := shop.Topology{Prefix: os.Getenv("E2E_PREFIX")}
	logger := watermill.NewStdLogger(false, false)
	pub, err := wamqp.NewPublisher(topo.PublisherConfig(testenv.AMQPURL()), logger)
	if err != nil {
		return err
	}
	crashpoint.Set(func(name string) {
		if name == crashpoint.OutboxAfterPublish {
			killSelf() // the broker confirmed; the row is not deleted yet
		}
	})
	relay, err := order.NewRelay(order.RelayConfig{
		Pool:         pool,
		Publisher:    pub,
		PollInterval: 10 * time.Millisecond,
		// A short lease (2 × PublishTimeout): the restarted relay takes
		// over soon after the SIGKILL.
		PublishTimeout: 500 * time.Millisecond,
		Logger:         logger,
	})
	if err != nil {
		return err
	}
	go func() { _ = relay.Run(context.Background()) }()
	return nil
}
