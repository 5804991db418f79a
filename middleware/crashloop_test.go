package middleware_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

const childEnv = "IDEMPOTENCY_MIDDLEWARE_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runCrashingConsumer())
	}
	os.Exit(m.Run())
}

// runCrashingConsumer is a consumer process whose handler kills it
// (SIGKILL: no defer, no rollback, as an OOM kill) on the redelivered
// event CHILD_EVENT.
func runCrashingConsumer() int {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("CHILD_SCHEMA")
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ps := gochannel.NewGoChannel(gochannel.Config{}, nil)
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: ps, Topic: "poison"},
	}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	handler := func(*message.Message) ([]*message.Message, error) {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	if at := os.Getenv("CHILD_KILL_AT"); at != "" {
		// The handler applies its effect; the process dies at the named
		// point instead.
		crashpoint.Set(func(name string) {
			if name == at {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
		})
		var calls atomic.Int32
		handler = effectHandler(&calls)
	}
	h, err := door.Wrap(c, "reserve", handler)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	msg := crashingEvent(os.Getenv("CHILD_EVENT"), os.Getenv("CHILD_REDELIVERED") == "true")
	if os.Getenv("CHILD_MARKED") == "true" { // a first delivery marked as one, as AMQP marks it
		marshaler.SetRedelivered(msg, os.Getenv("CHILD_REDELIVERED") == "true")
	}
	_, err = h(msg)
	fmt.Fprintln(os.Stderr, "the handler returned:", err)
	return 3
}

// crashingEvent is the event as the transport delivers it again: marked
// redelivered (AMQP, JetStream) or not (Kafka, Redis Streams).
func crashingEvent(id string, redelivered bool) *message.Message {
	msg := message.NewMessage(id, []byte(`{}`))
	msg.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	if redelivered {
		marshaler.SetRedelivered(msg, true)
	}
	return msg
}

// A message whose processing kills the process is dead-lettered once
// MaxCrashes attempts died in it, with the reason crash_loop; the message
// behind it is applied (issue 24: a crash-looping message must not block
// its queue forever). Whether the transport marks the redelivery (AMQP,
// JetStream, Redis Streams with CountingClient) or not (Kafka: counted in
// the consumer's first attempts after a start, where a message that killed
// it comes back).
func TestConsumerDeadLettersAMessageThatKillsTheProcess(t *testing.T) {
	t.Parallel()
	for _, redelivered := range []bool{true, false} {
		t.Run(map[bool]string{true: "redelivered", false: "unmarked"}[redelivered], func(t *testing.T) {
			t.Parallel()
			testCrashLoop(t, redelivered)
		})
	}
}

func testCrashLoop(t *testing.T, redelivered bool) {
	e := newConsumerEnv(t)
	schema := schemaOf(t, e.pool)
	event := newEvent(t).UUID
	for i := 0; i < middleware.DefaultMaxCrashes; i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_SCHEMA="+schema, "CHILD_EVENT="+event, fmt.Sprintf("CHILD_REDELIVERED=%t", redelivered))
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		require.ErrorAs(t, err, &exit, "child %d: %s", i, out)
		ws := exit.Sys().(syscall.WaitStatus)
		require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child %d must die by SIGKILL: %v %s", i, err, out)
	}

	c, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", effectHandler(&calls))
	require.NoError(t, err)
	poisoned, err := e.pubsub.Subscribe(context.Background(), "poison")
	require.NoError(t, err)

	_, err = h(crashingEvent(event, redelivered))
	require.NoError(t, err, "dead-lettered and acked")
	select {
	case p := <-poisoned:
		p.Ack()
		require.Equal(t, event, p.UUID)
		require.Contains(t, p.Metadata.Get("reason_poisoned"), "crash loop")
	case <-time.After(10 * time.Second):
		t.Fatal("the crash-looping message was not dead-lettered")
	}
	require.Zero(t, calls.Load(), "the handler never ran it again")

	next := newEvent(t)
	marshaler.SetRedelivered(next, redelivered)
	_, err = h(next)
	require.NoError(t, err)
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, 1, e.effects(t), "the message behind it is applied")
	var left int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "every ended attempt forgets its count")
}

// A counted attempt (a redelivery) whose process dies right after its
// commit, before the router acks, leaves no crash count: the count's end
// is in the attempt's transaction and commits with the claim. Its next
// redelivery is a duplicate, and nothing is counted for it.
func TestRedeliveryKilledAfterItsCommitLeavesNoCrashCount(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	schema := schemaOf(t, e.pool)
	event := newEvent(t).UUID
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_SCHEMA="+schema, "CHILD_EVENT="+event,
		"CHILD_REDELIVERED=true", "CHILD_KILL_AT="+crashpoint.AfterCommit)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	ws := exit.Sys().(syscall.WaitStatus)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "the child must die by SIGKILL: %v %s", err, out)
	require.Equal(t, 1, e.effects(t), "the attempt committed its effect")
	crashCount := func() int {
		var n int
		require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&n))
		return n
	}
	require.Zero(t, crashCount(), "the count ended with the commit")

	c, poison := consumerWithPoisonLog(t, e)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", effectHandler(&calls))
	require.NoError(t, err)
	_, err = h(crashingEvent(event, true))
	require.NoError(t, err, "acked")
	require.Zero(t, calls.Load(), "a duplicate")
	require.Equal(t, 1, e.effects(t))
	require.Empty(t, poison.poisoned())
	require.Zero(t, crashCount(), "nothing counted for the duplicate")
}

// A first delivery on a transport that marks redeliveries (redelivered
// "false", as AMQP and JetStream set it) writes no crash count, even among
// the first attempts after the consumer starts: the count starts with the
// first redelivery. A transport that marks nothing (Kafka) is counted in
// those first attempts.
func TestConsumerCountsNoCrashOnAMarkedFirstDelivery(t *testing.T) {
	t.Parallel()
	for _, marked := range []bool{true, false} {
		t.Run(map[bool]string{true: "marked", false: "unmarked"}[marked], func(t *testing.T) {
			t.Parallel()
			e := newConsumerEnv(t)
			c, err := middleware.NewConsumer(e.config("stock"), nil)
			require.NoError(t, err)
			var rows int
			h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
				// Another connection: the count is written in autocommit.
				return nil, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&rows)
			})
			require.NoError(t, err)
			msg := newEvent(t)
			if marked {
				marshaler.SetRedelivered(msg, false)
				marshaler.SetDeliveryCount(msg, 0)
			}
			_, err = h(msg)
			require.NoError(t, err)
			if marked {
				require.Zero(t, rows, "a first delivery the transport marks as such is not counted")
			} else {
				require.Equal(t, 1, rows, "an unmarked delivery in the first attempts after a start is counted")
			}
		})
	}
}

// A crash count left behind (a crash loop cut short by a redrive, a row
// restored from a backup) is never taken for more crashes than the broker
// counts deliveries: a message the broker delivered once before is not
// dead-lettered whatever the table says.
func TestConsumerCrashCountIsBoundedByTheBrokersDeliveryCount(t *testing.T) {
	t.Parallel()
	e := newConsumerEnv(t)
	msg := newEvent(t)
	_, err := e.pool.Exec(context.Background(), `INSERT INTO processed_event_crash (consumer, event_id, started) VALUES ('stock', $1, 10)`, msg.UUID)
	require.NoError(t, err)
	c, err := middleware.NewConsumer(e.config("stock"), nil)
	require.NoError(t, err)
	var calls atomic.Int32
	h, err := door.Wrap(c, "reserve", countingHandler(&calls))
	require.NoError(t, err)
	marshaler.SetRedelivered(msg, true)
	marshaler.SetDeliveryCount(msg, 1)
	_, err = h(msg)
	require.NoError(t, err)
	require.Equal(t, int32(1), calls.Load(), "handled, not dead-lettered as a crash loop")
}
