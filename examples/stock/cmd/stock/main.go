// Command stock is the example shop's stock service: it consumes
// "stock.events" and reserves each order line once.
//
// DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test?sslmode=disable)
// and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) locate the
// services; -workers sets the number of concurrent subscriptions.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/examples/stock"
	"github.com/watermill-idempotency/idempotency/processed"
)

func main() {
	workers := flag.Int("workers", 2, "concurrent subscriptions on the queue")
	flag.Parse()
	if err := run(*workers); err != nil {
		fmt.Fprintln(os.Stderr, "stock:", err)
		os.Exit(1)
	}
}

func env(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(workers int) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := stock.Migrate(ctx, pool, processed.Config{}); err != nil {
		return err
	}
	svc, err := shop.NewService(shop.ServiceConfig{
		AMQPURL:  env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		Consumer: stock.Consumer,
		Pool:     pool,
		Handler:  stock.Handle,
		Workers:  workers,
		Logger:   watermill.NewStdLogger(false, false),
	})
	if err != nil {
		return err
	}
	defer svc.Close()
	return svc.Run(ctx)
}
