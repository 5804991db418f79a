package outbox_test

import (
	"context"
	"net"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	idempotency "github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// afterPublish publishes through dest and calls f after the at-th publish
// that went through.
type afterPublish struct {
	dest message.Publisher
	n    atomic.Int64
	at   int64
	f    func()
}

func (a *afterPublish) Publish(topic string, msgs ...*message.Message) error {
	err := a.dest.Publish(topic, msgs...)
	if err == nil && a.n.Add(1) == a.at {
		a.f()
	}
	return err
}

func (a *afterPublish) Close() error { return nil }

// The relay's database stops answering (a partition, a paused VM: the
// connection stays open, nothing comes back) in the middle of a round,
// after publishes, before the round's delete. producer.md promises that
// the relay "logs a warning when the oldest pending row is older than
// StalledAfter" (and StatsInterval's doc: also while it backs off). The
// relay is blocked in the round's transaction with no bound: nothing is
// logged or recorded while the database hangs (until the kernel gives up
// on the connection, minutes later), so on-call sees a silent relay and
// stale gauges.
func TestRelayDatabaseHangIsReported(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 8)
	b := newBox(t, tg)
	rb := newRabbit(t)
	q := rb.queue("dbhang")
	for i := 0; i < 5; i++ {
		b.writeEvent(t, q)
	}
	u, err := url.Parse(testenv.PostgresURL())
	require.NoError(t, err)
	host := u.Host
	if _, _, err := net.SplitHostPort(host); err != nil {
		host = net.JoinHostPort(host, strconv.Itoa(5432))
	}
	proxy, err := faultproxy.Start(host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	relayPool := testenv.PoolAt(t, u.String(), tg.Database, 4)
	logger := newTestLogger()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: idempotency.Pgx(relayPool)}, logger)
	require.NoError(t, err)
	hung := make(chan struct{})
	dest := &afterPublish{dest: rb.pub, at: 2, f: func() { proxy.Hang(); close(hung) }}
	rec := &counts{}
	r, err := ob.NewRelay(dest, outbox.RelayConfig{StalledAfter: 500 * time.Millisecond, StatsInterval: 100 * time.Millisecond, Recorder: rec})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		proxy.Resume()
		require.NoError(t, r.Close())
		require.NoError(t, <-done)
	})
	select {
	case <-hung:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay published nothing")
	}
	reports := rec.reports.Load()
	reported := func() bool {
		c := logger.Captured()
		return len(c[watermill.ErrorLogLevel]) > 0 || rec.reports.Load() > reports
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && !reported() {
		time.Sleep(50 * time.Millisecond)
	}
	require.Equal(t, 5, b.pending(t), "rows pending (published, not deleted) while the relay's database hangs")
	require.True(t, reported(), "10 s into a database hang, with StalledAfter 500ms, the relay logged nothing and reported nothing")
}
