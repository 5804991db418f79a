package middleware_test

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// Every value NewConsumer refuses without reading the database is refused by
// ConsumerConfig.Validate too, naming the field to change: a caller that
// validates its configuration first (at flag parsing, in a config loader)
// is never told nil for a configuration NewConsumer then rejects.
func TestConsumerConfigValidateNamesEveryFieldNewConsumerRefuses(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	long := strings.Repeat("t", 60) // a valid name, too long for the partitions' suffix
	cases := []struct {
		name, field string
		mutate      func(*middleware.ConsumerConfig)
	}{
		{"blank consumer", "Consumer", func(c *middleware.ConsumerConfig) { c.Consumer = " " }},
		{"no database", "DB", func(c *middleware.ConsumerConfig) { c.DB = idempotency.DB{} }},
		{"invalid table name", "Table", func(c *middleware.ConsumerConfig) { c.Table = "processed event" }},
		{"table of three parts", "Table", func(c *middleware.ConsumerConfig) { c.Table = "a.b.c" }},
		{"unknown layout", "Layout", func(c *middleware.ConsumerConfig) { c.Layout = processed.Layout(7) }},
		{"partitioned table name too long", "Table", func(c *middleware.ConsumerConfig) {
			c.Table, c.Layout = long, processed.LayoutPartitioned
		}},
		{"negative replay horizon", "ReplayHorizon", func(c *middleware.ConsumerConfig) { c.ReplayHorizon = -time.Hour }},
		{"negative future skew", "MaxFutureSkew", func(c *middleware.ConsumerConfig) { c.MaxFutureSkew = -time.Second }},
		{"lock timeout below 1ms", "LockTimeout", func(c *middleware.ConsumerConfig) { c.LockTimeout = 500 * time.Microsecond }},
		{"lock timeout beyond PostgreSQL's range", "LockTimeout", func(c *middleware.ConsumerConfig) { c.LockTimeout = 30 * 24 * time.Hour }},
		{"lock timeout past the purger's slack", "LockTimeout", func(c *middleware.ConsumerConfig) { c.LockTimeout = 6 * time.Minute }},
		{"no poison publisher", "Poison.Publisher", func(c *middleware.ConsumerConfig) { c.Poison.Publisher = nil }},
		{"no poison topic", "Poison.Topic", func(c *middleware.ConsumerConfig) { c.Poison.Topic = "" }},
		{"header bound below 64", "Poison.MaxHeaderBytes", func(c *middleware.ConsumerConfig) { c.Poison.MaxHeaderBytes = 10 }},
		{"nil after-poison middleware", "AfterPoison", func(c *middleware.ConsumerConfig) {
			c.AfterPoison = []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc { return h }, nil}
		}},
		{"outbox topic without an outbox", "OutboxTopic", func(c *middleware.ConsumerConfig) { c.OutboxTopic = "shipping.requested" }},
		{"negative retries", "Retry.MaxRetries", func(c *middleware.ConsumerConfig) { c.Retry.MaxRetries = -1 }},
		{"multiplier below 1", "Retry.Multiplier", func(c *middleware.ConsumerConfig) { c.Retry.Multiplier = 0.5 }},
		{"negative initial interval", "Retry.InitialInterval", func(c *middleware.ConsumerConfig) { c.Retry.InitialInterval = -time.Second }},
		{"negative max interval", "Retry.MaxInterval", func(c *middleware.ConsumerConfig) {
			c.Retry.InitialInterval, c.Retry.MaxInterval = 0, -time.Second
		}},
	}
	check := func(t *testing.T, cfg middleware.ConsumerConfig, field string) {
		t.Helper()
		err := cfg.Validate()
		require.Error(t, err, "Validate accepts what NewConsumer refuses")
		require.ErrorContains(t, err, "ConsumerConfig."+field)
		_, err = middleware.NewConsumer(cfg, nil)
		require.Error(t, err, "NewConsumer accepts it")
		require.ErrorContains(t, err, "ConsumerConfig."+field)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.config("validate")
			tc.mutate(&cfg)
			check(t, cfg, tc.field)
		})
	}
	require.NoError(t, e.config("validate").Validate(), "the valid configuration")

	// What only another dialect refuses.
	t.Run("sqlite", func(t *testing.T) {
		tg := testenv.NewTarget(t, testenv.TargetSQLite, 1)
		for _, tc := range []struct {
			name, field string
			mutate      func(*middleware.ConsumerConfig)
		}{
			{"schema-qualified table", "Table", func(c *middleware.ConsumerConfig) { c.Table = "main.processed_event" }},
			{"partitioned layout", "Layout", func(c *middleware.ConsumerConfig) { c.Layout = processed.LayoutPartitioned }},
			{"joining a watermill-sql subscriber", "JoinSQLSubscriber", func(c *middleware.ConsumerConfig) { c.JoinSQLSubscriber = true }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				cfg := e.config("validate")
				cfg.DB = tg.Handle()
				tc.mutate(&cfg)
				check(t, cfg, tc.field)
			})
		}
	})
}
