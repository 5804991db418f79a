package kfaketest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

const (
	retryKillChildEnv = "CRASHLOOP_RETRY_CHILD"
	retryKillTopic    = "retrykill"
	retryKillDLQ      = "retrykill.dlq"
)

func init() {
	if os.Getenv(retryKillChildEnv) == "" {
		return
	}
	if err := retryKillChild(); err != nil {
		fmt.Fprintln(os.Stderr, "retrykill child:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

// retryKillChild is a member of the group: its handler kills the process
// on the poisoned event's retry (its first attempt in the process failed,
// as on a dependency that is down while the member starts), once the
// member has applied 64 other events (past its start's first 64 attempts).
func retryKillChild() error {
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("CRASHLOOP_SCHEMA")
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return err
	}
	brokers := strings.Split(os.Getenv("CRASHLOOP_KAFKA_BROKERS"), ",")
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: "retrykill",
		OverwriteSaramaConfig: crashLoopSaramaConfig(),
	}, logger)
	if err != nil {
		return err
	}
	dlq, err := crashLoopPublisher(brokers, logger)
	if err != nil {
		return err
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "retrykill", DB: idempotency.Pgx(pool),
		Poison: middleware.PoisonConfig{Publisher: dlq, Topic: retryKillDLQ},
		Retry:  middleware.RetryConfig{MaxRetries: 100000, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	poison := os.Getenv("CRASHLOOP_POISON")
	var applied atomic.Int64
	var ready atomic.Bool // the poison's last failed attempt ended after 64 others were applied: its next attempt is past the warm-up
	if _, err := c.AddConsumerHandler(router, "retrykill", retryKillTopic, sub, func(msg *message.Message) error {
		if msg.UUID == poison {
			if !ready.Load() {
				ready.Store(applied.Load() >= 64)
				return errors.New("retrykill child: the dependency is down")
			}
			fmt.Fprintln(os.Stderr, "retrykill child: poisoned event on a retry, SIGKILL")
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		applied.Add(1)
		return nil
	}); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	return router.Run(ctx)
}

// A record whose first attempt in a member fails and whose chain retry
// kills the member, after the member's first 64 attempts, on a topic of 16
// partitions under a steady producer (the scenario of
// TestCrashLoopOnKafkaDeadLettersOnlyThePoisonUnderLoadOnManyPartitions):
// its retry is the same offset given back after an attempt of it ended in
// the member, and it is counted as its first attempt was (the first record
// of its partition after each start), so the record is dead-lettered after
// MaxCrashes deaths and the other events are applied once. When a retry
// "followed" the ended attempt, past the first 64 attempts no death was
// counted and the record killed members for ever.
func TestKafkaRecordKillingMembersOnItsRetryIsDeadLetteredAfterMaxCrashes(t *testing.T) {
	ctx := context.Background()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(16, retryKillTopic), kfake.SeedTopics(1, retryKillDLQ))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()

	consumer, err := sarama.NewConsumer(brokers, crashLoopSaramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = consumer.Close() })
	dlq, err := consumer.ConsumePartition(retryKillDLQ, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dlq.Close() })

	pool, schema := testenv.Pool(t)
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)

	pub, err := crashLoopPublisher(brokers, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	var msgs []*message.Message
	publish := func(n int) {
		var batch []*message.Message
		for i := 0; i < n; i++ {
			m, err := marshaler.NewMessage("order.placed", map[string]int{"n": len(msgs)})
			require.NoError(t, err)
			msgs = append(msgs, m)
			batch = append(batch, m)
		}
		require.NoError(t, pub.Publish(retryKillTopic, batch...))
	}
	publish(1)
	poison := msgs[0].UUID

	var dead []string
	collect := func() {
		for {
			select {
			case rec := <-dlq.Messages():
				m, err := kafka.Marshaler{}.Unmarshal(rec)
				require.NoError(t, err)
				dead = append(dead, m.UUID+" ("+m.Metadata.Get("reason_poisoned")+")")
			default:
				return
			}
		}
	}
	allowed := middleware.DefaultMaxCrashes // the first record of its partition: counted in every member
	crashes := 0
	for finished := false; !finished; {
		if crashes > allowed+1 {
			var counts []string
			rows, err := pool.Query(ctx, `SELECT event_id::text, started FROM processed_event_crash`)
			require.NoError(t, err)
			for rows.Next() {
				var id string
				var n int
				require.NoError(t, rows.Scan(&id, &n))
				if id == poison {
					id = "poison"
				}
				counts = append(counts, fmt.Sprintf("%s: %d", id, n))
			}
			require.NoError(t, rows.Err())
			t.Fatalf("the poisoned record killed %d members (at most %d allowed) and was not dead-lettered; crash counts %v",
				crashes, allowed, counts)
		}
		publish(200) // the producers do not stop while members crash
		var out strings.Builder
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), retryKillChildEnv+"=1", "CRASHLOOP_SCHEMA="+schema, "CRASHLOOP_POISON="+poison,
			"CRASHLOOP_KAFKA_BROKERS="+strings.Join(brokers, ","))
		cmd.Stdout, cmd.Stderr = &out, &out
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		deadline := time.Now().Add(2 * time.Minute) // a hang guard, not a measurement
	wait:
		for {
			select {
			case <-exited:
				ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
				if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
					t.Fatalf("child ended with %s; output:\n%s", cmd.ProcessState, out.String())
				}
				crashes++
				break wait
			case <-time.After(200 * time.Millisecond):
				collect()
				var applied int
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM effect`).Scan(&applied))
				if len(dead) > 0 && applied+len(dead) >= len(msgs) {
					_ = cmd.Process.Signal(syscall.SIGTERM)
					<-exited
					finished = true
					break wait
				}
				if time.Now().After(deadline) {
					_ = cmd.Process.Kill()
					<-exited
					t.Fatalf("child %d neither crashed nor finished (%d applied); output:\n%s", crashes+1, applied, out.String())
				}
			}
		}
	}
	collect()
	t.Logf("%d crashes, dead letters %v", crashes, dead)
	require.Len(t, dead, 1)
	require.True(t, strings.HasPrefix(dead[0], poison), "only the poisoned record is dead-lettered: %v", dead)
	require.LessOrEqual(t, crashes, allowed)
}
