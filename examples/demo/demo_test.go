package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// lastJSON decodes the last line of out.
func lastJSON(t *testing.T, out string) map[string]any {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var m map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[len(lines)-1]), &m), "last line:\n%s", lines[len(lines)-1])
	return m
}

// smallConfig is a small run on the real services (PostgreSQL and RabbitMQ),
// whatever the environment says: CI runs that path.
func smallConfig() config {
	c := defaultConfig()
	c.Backend = backendServices
	c.Orders = 60
	c.CutEvery = 15
	c.RelayFail = 0.5
	c.BatchSize = 10
	c.ReplayShare = 0.3
	c.Reorder = 0.2
	c.Progress = 0
	// A guard against a run that never settles, not a speed check: the run
	// ends as soon as its work is done (14 s on a quiet machine), and CI
	// runs it beside every other package's tests.
	c.Timeout = 5 * time.Minute
	c.Products = 10
	c.Updates = 8
	c.IndexLatency = 5 * time.Millisecond
	c.ProviderTimeoutEvery = 7
	c.Seed = 7
	return c
}

// The demo on real services with a small N prints "ok":true as its last
// line, and the faults it injects were exercised.
func TestDemo(t *testing.T) {
	t.Parallel()
	checkDemo(t, smallConfig())
}

// -partitioned: stock and shipping on processed.LayoutPartitioned pass the
// same checks on PostgreSQL; the claims landed in time partitions.
func TestDemoPartitioned(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Partitioned = true
	checkDemo(t, c)
}

// The embedded default (SQLite files and the in-process broker, nothing
// installed) passes the same checks, with the same faults.
func TestDemoEmbedded(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.Backend = backendEmbedded
	c.DatabaseURL, c.AMQPURL = "postgres://unused.invalid/", "amqp://unused.invalid/" // never dialled
	checkDemo(t, c)
}

// Without DATABASE_URL and AMQP_URL the demo runs embedded; with either,
// on the services.
func TestDemoDefaultBackend(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("AMQP_URL", "")
	require.Equal(t, backendEmbedded, defaultConfig().Backend)
	t.Setenv("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	require.Equal(t, backendServices, defaultConfig().Backend)
}

func checkDemo(t *testing.T, cfg config) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(context.Background(), cfg, &out, &errb)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	require.Contains(t, out.String(), `"ok":true`)
	m := lastJSON(t, out.String())
	first, _, _ := strings.Cut(out.String(), "\n")
	require.True(t, strings.HasPrefix(first, "demo: backend "+cfg.Backend+":"), "the first line names the backend: %q", first)
	require.Equal(t, cfg.Backend, m["backend"], "the last line names the backend")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.True(t, strings.HasPrefix(lines[len(lines)-1], `{"backend":"`+cfg.Backend+`"`), "the last line starts with the backend: %q", lines[len(lines)-1])
	for _, k := range []string{"orders", "deliveries", "reservations", "expected_reservations", "duplicates_skipped", "stale_skipped", "poisoned", "lost",
		"charges", "expected_charges", "mails", "index_updates", "obsolete_skipped", "ok"} {
		require.Contains(t, m, k)
	}
	require.Equal(t, m["expected_reservations"], m["reservations"])
	require.EqualValues(t, 0, m["lost"])
	// Each malformed message in each of the 5 dead-letter queues, once per
	// delivery: again only when a connection cut lost the ack of its poisoned
	// delivery (the demo's checks tell those from a requeue loop).
	require.Equal(t, m["expected_poisoned"], m["poisoned"])
	require.GreaterOrEqual(t, m["poisoned"].(float64), 6.0*5)

	// Billing: each order charged once despite the provider's timeouts, one
	// e-mail per charge, nothing left uncertain.
	require.EqualValues(t, 60, m["expected_charges"])
	require.Equal(t, m["expected_charges"], m["charges"])
	require.Equal(t, m["charges"], m["mails"])
	require.EqualValues(t, 60/7, m["provider_timeouts"])
	require.Equal(t, m["provider_timeouts"], m["charges_reconciled"], "every timeout settled by a lookup, never a second charge")
	require.EqualValues(t, 0, m["reconcile_routed"])

	// Indexer: the index holds every product's latest version; every update
	// was indexed or skipped once, and the filter skipped some.
	require.EqualValues(t, 10, m["index_latest"])
	require.EqualValues(t, 10*8, m["product_updates"])
	require.EqualValues(t, 10*8, m["index_updates"].(float64)+m["obsolete_skipped"].(float64)+m["index_stale_skipped"].(float64))
	require.GreaterOrEqual(t, m["index_updates"].(float64), 10.0)
	require.Greater(t, m["obsolete_skipped"].(float64), 0.0)

	require.Greater(t, m["duplicates_skipped"].(float64), 0.0, "relay republish, cuts and replay produce duplicates")
	require.Greater(t, m["connection_cuts"].(float64), 0.0)
	require.Greater(t, m["relay_republished"].(float64), 0.0)
	require.Greater(t, m["replayed"].(float64), 0.0)
}

// The checks catch double effects: with event ids assigned on reception the
// duplicates pass the claim, and the demo says so and exits 1.
func TestDemoCatchesIDsAssignedAtReception(t *testing.T) {
	t.Parallel()
	for _, backend := range []string{backendServices, backendEmbedded} {
		t.Run(backend, func(t *testing.T) {
			t.Parallel()
			c := smallConfig()
			c.Backend = backend
			c.Orders = 30
			c.IDAtReception = true
			catchesIDsAtReception(t, c)
		})
	}
}

func catchesIDsAtReception(t *testing.T, c config) {
	t.Helper()
	// The run settles without waiting for the index (the latest filter
	// cannot work on fresh ids); the guard is shorter than a correct run's.
	c.Timeout = 2 * time.Minute
	var out, errb bytes.Buffer
	code := run(context.Background(), c, &out, &errb)
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	m := lastJSON(t, out.String())
	require.Equal(t, false, m["ok"])
	require.Greater(t, m["reservations"].(float64), m["expected_reservations"].(float64))
	require.Contains(t, out.String(), "duplicate reservations")
	// The operation key still charges each order once; the e-mails, which
	// rely on the claim alone, go out more than once.
	require.Equal(t, m["expected_charges"], m["charges"])
	require.Greater(t, m["mails"].(float64), m["charges"].(float64))
}

func TestDemoFlags(t *testing.T) {
	t.Parallel()
	var errb bytes.Buffer
	c, err := parseFlags([]string{"-orders", "5", "-relay-fail", "0"}, &errb)
	require.NoError(t, err)
	require.Equal(t, 5, c.Orders)
	for _, bad := range [][]string{{"-orders", "0"}, {"-relay-fail", "2"}, {"-status-changes", "9"}, {"-workers", "0"},
		{"-products", "0"}, {"-updates", "0"}, {"-provider-timeout-every", "-1"}, {"-index-latency", "-1s"}, {"-backend", "redis"}} {
		_, err := parseFlags(bad, &errb)
		require.Error(t, err, bad)
	}
}

// A service that cannot be reached makes the run fail with status 2.
func TestDemoUnreachableService(t *testing.T) {
	t.Parallel()
	c := smallConfig()
	c.AMQPURL = "amqp://guest:guest@127.0.0.1:1/"
	var out, errb bytes.Buffer
	require.Equal(t, 2, run(context.Background(), c, &out, &errb))
	require.Contains(t, errb.String(), "RabbitMQ")
}

// The first line names the backend without the services' passwords.
func TestBackendLine(t *testing.T) {
	c := defaultConfig()
	c.Backend, c.DatabaseURL, c.AMQPURL = backendServices, "postgres://u:secret@db:5432/x", "amqp://guest:guest@mq:5672/"
	line := backendLine(c)
	require.Equal(t, "backend services: PostgreSQL postgres://u:xxxxx@db:5432/x, RabbitMQ amqp://guest:xxxxx@mq:5672/", line)
	c.Backend = backendEmbedded
	require.Contains(t, backendLine(c), "backend embedded: SQLite")
}
