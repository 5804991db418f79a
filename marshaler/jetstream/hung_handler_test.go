package jetstream

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The child of TestHungHandlerKilledByLivenessProbeIsDeadLetteredAsCrashLoop:
// a JetStream consumer whose handler hangs on the poisoned event (and never
// returns: the process is killed from outside, as a liveness probe does).
func init() {
	if os.Getenv("IDEM_HUNG_CHILD") == "" {
		return
	}
	if err := hungChild(); err != nil {
		fmt.Fprintln(os.Stderr, "hung child:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

func hungChild() error {
	logger := watermill.NewStdLoggerWithOut(os.Stderr, true, false)
	pcfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("IDEM_HUNG_SCHEMA")
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return err
	}
	stream := os.Getenv("IDEM_HUNG_STREAM")
	sub, err := NewSubscriber(SubscriberConfig{
		URL: testenv.NATSURL(), Stream: stream, Durable: "hung",
		AckWait: time.Second, MaxHold: time.Second,
	}, logger)
	if err != nil {
		return err
	}
	poison, err := NewPublisher(PublisherConfig{URL: testenv.NATSURL()})
	if err != nil {
		return err
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "hung", DB: idempotency.Pgx(pool), LockTimeout: 500 * time.Millisecond,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: stream + ".dlq"},
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	hung := os.Getenv("IDEM_HUNG_POISON")
	if _, err := c.AddConsumerHandler(router, "hung", stream+".events", sub, func(msg *message.Message) error {
		if msg.UUID == hung {
			fmt.Fprintln(os.Stderr, "HUNG-HANDLER-STARTED")
			select {} // hangs until the liveness probe kills the process
		}
		return nil
	}); err != nil {
		return err
	}
	return router.Run(context.Background())
}

// guarantees.md: "A message that kills the process is dead-lettered. An
// attempt that starts and never ends (…, a liveness probe killing a hung
// handler) is counted … After ConsumerConfig.MaxCrashes (3) such attempts
// died the next delivery is dead-lettered with reason crash_loop …: at the
// MaxCrashes+2nd delivery on a marking transport".
//
// Here a handler hangs on one event and a liveness probe (this test)
// SIGKILLs the consumer each time, once JetStream has redelivered the hung
// delivery into it (past MaxHold the subscriber stops its progress acks):
// that copy waits for the process's counted turn, which the hung attempt
// holds, and writes nothing. When such a copy ran and failed on the hung
// attempt's claim, its end deleted the event's whole count (as it once
// did), erasing the start of the hung attempt and of every earlier killed
// one: the event was never dead-lettered and killed every consumer
// forever.
func TestHungHandlerKilledByLivenessProbeIsDeadLetteredAsCrashLoop(t *testing.T) {
	stream, js := testStream(t, testenv.NATSURL())
	t.Cleanup(func() { _ = js.DeleteConsumer(stream, "hung") })
	dlq, err := js.SubscribeSync(stream+".dlq", nats.DeliverAll(), nats.AckNone())
	require.NoError(t, err)
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))

	e := newEvent(t)
	pub, err := NewPublisher(PublisherConfig{URL: testenv.NATSURL()})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(stream+".events", e))
	require.NoError(t, pub.Close())

	deadLettered := func() bool {
		nm, err := dlq.NextMsg(10 * time.Millisecond)
		if errors.Is(err, nats.ErrTimeout) {
			return false
		}
		require.NoError(t, err)
		m, err := Marshaler{}.Unmarshal(nm)
		require.NoError(t, err)
		require.Equal(t, e.UUID, m.UUID)
		require.Contains(t, m.Metadata.Get("reason_poisoned"), "crash loop")
		return true
	}
	const maxKills = 10 // MaxCrashes+1 (= 4) kills are the most the bound allows
	for kills := 0; ; kills++ {
		var counted int
		_ = pool.QueryRow(ctx, `SELECT coalesce(sum(started), 0) FROM processed_event_crash`).Scan(&counted)
		if kills > maxKills {
			t.Fatalf("the hung event killed %d consumers and was never dead-lettered (MaxCrashes %d); crash count now %d",
				kills, middleware.DefaultMaxCrashes, counted)
		}
		t.Logf("consumer %d starts; crash count of the event: %d", kills+1, counted)
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "IDEM_HUNG_CHILD=1", "IDEM_HUNG_SCHEMA="+schema,
			"IDEM_HUNG_STREAM="+stream, "IDEM_HUNG_POISON="+e.UUID)
		stderr, err := cmd.StderrPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		// The probe: the handler hung, and JetStream redelivered the hung
		// delivery to the process.
		redelivered := func() uint64 { // deliveries of the durable so far
			ci, err := js.ConsumerInfo(stream, "hung")
			if err != nil {
				return 0
			}
			return ci.Delivered.Consumer
		}
		before := redelivered()
		var mu sync.Mutex
		hung := false
		lines := make(chan struct{}, 1)
		var tail []string
		go func() {
			sc := bufio.NewScanner(stderr)
			sc.Buffer(make([]byte, 1<<20), 1<<20)
			for sc.Scan() {
				l := sc.Text()
				mu.Lock()
				tail = append(tail, l)
				if strings.Contains(l, "HUNG-HANDLER-STARTED") {
					hung = true
				}
				mu.Unlock()
				select {
				case lines <- struct{}{}:
				default:
				}
			}
			_, _ = io.Copy(io.Discard, stderr)
			close(lines)
		}()
		deadline := time.Now().Add(2 * time.Minute) // a hang guard
		for done := false; !done; {
			select {
			case _, ok := <-lines:
				if !ok {
					_ = cmd.Wait()
					t.Fatalf("child exited by itself: %s\n%s", cmd.ProcessState, strings.Join(tail, "\n"))
				}
			case <-time.After(100 * time.Millisecond):
			}
			if deadLettered() {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				t.Logf("dead-lettered after %d kills", kills)
				return
			}
			mu.Lock()
			done = hung
			mu.Unlock()
			done = done && redelivered() > before+1 // the hung delivery, then another
			if time.Now().After(deadline) {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				mu.Lock()
				defer mu.Unlock()
				t.Fatalf("child %d neither hung and was redelivered nor dead-lettered:\n%s", kills+1, strings.Join(tail, "\n"))
			}
		}
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL)) // the liveness probe
		_ = cmd.Wait()
	}
}
