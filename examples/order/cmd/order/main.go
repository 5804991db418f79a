// Command order is the example shop's producer service.
//
//	order migrate                          create the tables (orders, outbox)
//	order place [-n 10]                    place n random orders
//	order status -order o-1 -status shipped change an order's status
//	order relay                            relay the outbox to RabbitMQ until interrupted
//	order replay -from T1 -to T2           republish the events that occurred in [T1, T2) (RFC 3339)
//
// DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test?sslmode=disable)
// and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) locate the services.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/examples/order"
	"github.com/watermill-idempotency/idempotency/examples/shop"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "order:", err)
		os.Exit(1)
	}
}

func env(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: order migrate|place|status|relay|replay [flags]")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	logger := watermill.NewStdLogger(false, false)
	svc, err := order.New(order.Config{Pool: pool, Logger: logger})
	if err != nil {
		return err
	}
	amqpURL := env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	topo := shop.Topology{}
	fs := flag.NewFlagSet(args[0], flag.ExitOnError)
	switch args[0] {
	case "migrate":
		return svc.Migrate(ctx)
	case "place":
		n := fs.Int("n", 10, "orders to place")
		_ = fs.Parse(args[1:])
		for i := 0; i < *n; i++ {
			id := "o-" + uuid.NewString()[:8]
			lines := []shop.OrderLine{{SKU: fmt.Sprintf("sku-%d", rand.IntN(20)), Quantity: fmt.Sprintf("%d.%03d", 1+rand.IntN(5), rand.IntN(1000))}}
			evID, err := svc.PlaceOrder(ctx, id, lines)
			if err != nil {
				return err
			}
			fmt.Println(id, evID)
		}
		return nil
	case "status":
		id := fs.String("order", "", "order id")
		st := fs.String("status", "", "new status")
		_ = fs.Parse(args[1:])
		v, evID, err := svc.ChangeStatus(ctx, *id, *st)
		if err != nil {
			return err
		}
		fmt.Println(*id, "version", v, evID)
		return nil
	case "relay", "replay":
		pub, err := wamqp.NewPublisher(topo.PublisherConfig(amqpURL), logger)
		if err != nil {
			return err
		}
		defer pub.Close()
		if args[0] == "replay" {
			from := fs.String("from", "", "start of the range (RFC 3339, inclusive)")
			to := fs.String("to", time.Now().UTC().Format(time.RFC3339), "end of the range (RFC 3339, exclusive)")
			_ = fs.Parse(args[1:])
			f, err := time.Parse(time.RFC3339Nano, *from)
			if err != nil {
				return fmt.Errorf("-from: %w", err)
			}
			t, err := time.Parse(time.RFC3339Nano, *to)
			if err != nil {
				return fmt.Errorf("-to: %w", err)
			}
			n, err := svc.Replay(ctx, pub, f, t)
			fmt.Println("replayed", n, "events")
			return err
		}
		relay, err := order.NewRelay(order.RelayConfig{Pool: pool, Publisher: pub, Logger: logger})
		if err != nil {
			return err
		}
		return relay.Run(ctx)
	default:
		return fmt.Errorf("unknown command %q", args[0])
	}
}
