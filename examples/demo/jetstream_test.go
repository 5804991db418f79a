package main

import (
	"testing"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The demo on PostgreSQL and NATS JetStream passes the same checks, with the
// same faults (cuts through a proxy in front of NATS, relay republishes,
// replays, malformed messages, reordering, provider timeouts).
func TestDemoJetStream(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Backend = backendJetStream
	c.NATSURL = testenv.NATSURL()
	checkDemo(t, c)
}

// With event ids assigned on reception the checks fail on JetStream too.
func TestDemoJetStreamCatchesIDsAssignedAtReception(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Backend = backendJetStream
	c.NATSURL = testenv.NATSURL()
	c.Orders = 30
	c.IDAtReception = true
	catchesIDsAtReception(t, c)
}
