package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The outbox's rows are written in each attempt's transaction on DB, in the
// outbox's SQL: an outbox built for another kind of database than DB could
// write none (a syntax error, SQLSTATE 42601 on PostgreSQL), and every event
// whose handler produces a message would be dead-lettered as poison.
// NewConsumer and Validate refuse it, naming Outbox and both dialects, so no
// router ever runs it. An outbox in DB's dialect is accepted, also one built
// on another handle of DB's database (there: a database/sql pool on the
// PostgreSQL schema the consumer's pgx pool uses).
func TestNewConsumerRefusesAnOutboxOnAnotherKindOfDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 4)
	targets := []testenv.Target{pg, testenv.NewTarget(t, testenv.TargetMariaDB, 4), testenv.NewTarget(t, testenv.TargetSQLite, 4)}
	outboxes := make([]*outbox.Outbox, len(targets))
	for i, tg := range targets {
		require.NoError(t, processed.Migrate(ctx, tg.Handle(), processed.Config{}), tg.Name)
		var err error
		outboxes[i], err = outbox.New(outbox.Config{DB: tg.Handle()}, nil)
		require.NoError(t, err, tg.Name)
	}
	poison := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = poison.Close() })
	config := func(consumer string, db testenv.Target, ob *outbox.Outbox) middleware.ConsumerConfig {
		return middleware.ConsumerConfig{
			Consumer: consumer, DB: db.Handle(), Outbox: ob,
			Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
		}
	}

	for i, db := range targets {
		for j, obDB := range targets {
			if i == j {
				continue
			}
			t.Run("DB="+db.Name+"/Outbox="+obDB.Name, func(t *testing.T) {
				cfg := config("refused-"+obDB.Name, db, outboxes[j])
				for what, err := range map[string]error{"Validate": cfg.Validate(), "NewConsumer": newConsumerErr(cfg)} {
					require.Error(t, err, "%s accepted an outbox for %s with a DB on %s", what, obDB.Dialect, db.Dialect)
					require.ErrorContains(t, err, "ConsumerConfig.Outbox", what)
					require.ErrorContains(t, err, obDB.Dialect.String(), what)
					require.ErrorContains(t, err, db.Dialect.String(), what)
				}
			})
		}
		c, err := middleware.NewConsumer(config("accepted", db, outboxes[i]), nil)
		require.NoError(t, err, "an outbox on DB itself (%s)", db.Name)
		require.NotNil(t, c)
	}

	// Another handle of the same database and dialect can write in DB's
	// transactions and its relay reads the same table: accepted.
	std := testenv.OpenTarget(t, testenv.TargetPostgresStdlib, pg.Database, 2)
	ob, err := outbox.New(outbox.Config{DB: std.Handle()}, nil)
	require.NoError(t, err)
	_, err = middleware.NewConsumer(config("other-handle", pg, ob), nil)
	require.NoError(t, err)

	// An Outbox that outbox.New did not build has no database to compare.
	_, err = middleware.NewConsumer(config("zero", pg, &outbox.Outbox{}), nil)
	require.ErrorContains(t, err, "ConsumerConfig.Outbox: not built by outbox.New")
}

func newConsumerErr(cfg middleware.ConsumerConfig) error {
	_, err := middleware.NewConsumer(cfg, nil)
	return err
}
