package versioned_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// exampleBroker stands for the broker (or the outbox) in the example: it
// keeps what is published.
type exampleBroker struct{ msgs []*message.Message }

func (b *exampleBroker) Publish(_ string, msgs ...*message.Message) error {
	b.msgs = append(b.msgs, msgs...)
	return nil
}
func (b *exampleBroker) Close() error { return nil }

// A product is updated three times before the indexer runs: the indexer's
// handler runs once, for the last update; the two others are acked as
// obsolete.
func ExampleNewLatestFilter() {
	ctx := context.Background()
	// A schema of its own keeps the example self-contained.
	admin, err := pgxpool.New(ctx, testenv.PostgresURL())
	if err != nil {
		panic(err)
	}
	defer admin.Close()
	schema := testenv.UniqueName("example")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		panic(err)
	}
	defer func() { _, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE") }()
	pool, err := pgxpool.New(ctx, testenv.SchemaURL(schema))
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	// Once, at start: the stores and their tables.
	families, _ := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	if err := families.Migrate(ctx, idempotency.Pgx(pool)); err != nil {
		panic(err)
	}
	if err := processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}); err != nil {
		panic(err)
	}

	// Producer: each update in its transaction, the latest record with it.
	broker := &exampleBroker{}
	for version := int64(1); version <= 3; version++ {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			pub, err := versioned.NewLatestPublisher(broker, versioned.LatestPublisherConfig{
				Store: families, Tx: idempotency.PgxTx(tx)}, nil)
			if err != nil {
				return err
			}
			msg, err := marshaler.NewMessage("catalogue.product.updated.v1", map[string]any{"sku": "p-1", "version": version})
			if err != nil {
				return err
			}
			if err := versioned.SetFamilySeq(msg, versioned.Family{Kind: "catalogue.product", ID: "p-1"}, version); err != nil {
				return err
			}
			return pub.Publish("catalogue.product.updated.v1", msg)
		})
		if err != nil {
			panic(err)
		}
	}

	// Consumer: the consumer's chain → LatestFilter → handler. Obsolete
	// messages reach the consumer's Recorder as middleware.OutcomeObsolete.
	outcomes := &idempotencytest.Outcomes{}
	poison := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer poison.Close()
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "indexer", DB: idempotency.Pgx(pool), Recorder: outcomes,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "indexer.poison"},
	}, nil)
	if err != nil {
		panic(err)
	}
	filter, _ := versioned.NewLatestFilter(versioned.LatestFilterConfig{Families: families, Consumer: "indexer"}, nil)
	s := idempotencytest.Subject{Consumer: c, Handler: filter.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		fmt.Println("indexed", msg.Metadata.Get(versioned.MetadataFamilyID), "at version", msg.Metadata.Get(versioned.MetadataFamilySeq))
		return nil, nil
	})}
	for _, msg := range broker.msgs {
		if _, err := idempotencytest.Deliver(s, msg); err != nil {
			panic(err)
		}
	}
	fmt.Println("skipped as obsolete:", outcomes.Count(middleware.OutcomeObsolete))
	// Output:
	// indexed p-1 at version 3
	// skipped as obsolete: 2
}
