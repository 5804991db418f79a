package middleware_test

import (
	"context"
	"database/sql"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// On MySQL/MariaDB the processed table's consumer column is varbinary(255).
// A ConsumerConfig.Consumer longer than that is a configuration mistake that
// can never be applied: every claim fails with 1406 (Data too long). It must
// be refused where it is made (NewConsumer, naming ConsumerConfig.Consumer),
// like an empty name. Before this test NewConsumer and AddConsumerHandler
// accepted it; every delivery was then held as a *transient* infrastructure
// failure (logged at INFO only, "delivery held, not poisoned"), nacked after
// MaxHold and held again, so the consumer applied nothing for ever, and the
// only ERROR said "Could not record the consumer's handler name (run
// processed.Migrate)", which is not the fix.
func TestConsumerRefusesANameLongerThanTheMySQLColumn(t *testing.T) {
	t.Parallel()
	name := testenv.MySQLDatabase(t)
	ctx := context.Background()
	db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(name))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	h := idempotency.SQL(db, idempotency.MySQL)
	require.NoError(t, processed.Migrate(ctx, h, processed.Config{}))

	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	e := consumerEnv{db: h, pubsub: ps}
	cfg := e.config(strings.Repeat("c", 256))
	cfg.Retry.MaxHold = 500 * time.Millisecond
	c, err := middleware.NewConsumer(cfg, nil)
	if err == nil {
		// What the refusal prevents: a consumer that can never claim.
		var calls atomic.Int32
		handler, werr := door.Wrap(c, "reserve", countingHandler(&calls))
		require.NoError(t, werr)
		_, herr := handler(newEvent(t))
		t.Fatalf("NewConsumer accepted a 256-byte consumer name on MySQL (column varbinary(255)): "+
			"the delivery failed with %v (transient: %v, configuration: %v), handler calls %d",
			herr, middleware.IsTransient(herr), middleware.IsConfiguration(herr), calls.Load())
	}
	require.ErrorContains(t, err, "ConsumerConfig.Consumer")
}
