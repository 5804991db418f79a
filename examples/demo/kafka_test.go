package main

import "testing"

// The demo on PostgreSQL and an in-process Kafka-protocol cluster (the
// kafkapeer program it builds and starts; no Kafka server) passes the same
// checks, with the same faults (cuts that close a consumer's group members
// before the ack, relay republishes, replays, malformed records,
// reordering, provider timeouts).
func TestDemoKafka(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Backend = backendKafka
	checkDemo(t, c)
}

// With event ids assigned on reception the checks fail on Kafka too.
func TestDemoKafkaCatchesIDsAssignedAtReception(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Backend = backendKafka
	c.Orders = 30
	c.IDAtReception = true
	catchesIDsAtReception(t, c)
}
