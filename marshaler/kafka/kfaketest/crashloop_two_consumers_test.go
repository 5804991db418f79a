package kfaketest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
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
	twoConsChildEnv = "CRASHLOOP_TWOCONS_CHILD"
	twoConsTopic    = "twocons"
	twoConsDLQ      = "twocons.dlq"
)

func init() {
	if os.Getenv(twoConsChildEnv) == "" {
		return
	}
	if err := twoConsChild(); err != nil {
		fmt.Fprintln(os.Stderr, "twocons child:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

// twoConsChild is one service process with two consumers ("stock" and
// "analytics", a consumer group each) of the same topic; the poisoned
// event kills the process in either handler.
func twoConsChild() error {
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
	dlq, err := crashLoopPublisher(brokers, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	poison := os.Getenv("CRASHLOOP_POISON")
	for _, name := range []string{"stock", "analytics"} {
		sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
			Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: name,
			OverwriteSaramaConfig: crashLoopSaramaConfig(),
		}, logger)
		if err != nil {
			return err
		}
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer: name, DB: idempotency.Pgx(pool),
			Poison: middleware.PoisonConfig{Publisher: dlq, Topic: twoConsDLQ},
		}, logger)
		if err != nil {
			return err
		}
		if _, err := c.AddConsumerHandler(router, name, twoConsTopic, sub, func(msg *message.Message) error {
			if msg.UUID == poison {
				fmt.Fprintln(os.Stderr, "twocons child: poisoned event in", name, ", SIGKILL")
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO effect (consumer, event_id) VALUES ($1, $2)`, name, msg.UUID)
			return err
		}); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	return router.Run(ctx)
}

// One service process with two consumers of one topic (a consumer group
// each, as transports.md asks: "per consumer a group per bound topic"),
// and a record that kills the process in either handler. The crash bound
// is per consumer: counted attempts run one at a time in the process,
// whatever the consumer, so each death is counted for the one consumer
// whose attempt was running, never for the other one, which waited (its
// handler might have taken the record well). Each consumer dead-letters
// the record after MaxCrashes deaths in its own attempts: the process dies
// at most 2×MaxCrashes times (docs/guarantees.md), and every other record
// is applied once by each consumer. A death between one consumer's dead
// letter and its ack (the other consumer's attempt, running as soon as
// the first one's ended) dead-letters the record again for that consumer:
// another copy, as docs/guarantees.md and transports.md (a crash before
// the offset commit) say.
func TestKafkaRecordKillingAProcessWithTwoConsumersIsDeadLetteredByEachAfterItsOwnDeaths(t *testing.T) {
	ctx := context.Background()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, twoConsTopic, twoConsDLQ))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()
	consumer, err := sarama.NewConsumer(brokers, crashLoopSaramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = consumer.Close() })
	dlqc, err := consumer.ConsumePartition(twoConsDLQ, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dlqc.Close() })

	pool, schema := testenv.Pool(t)
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (consumer text NOT NULL, event_id text NOT NULL)`)
	require.NoError(t, err)
	pub, err := crashLoopPublisher(brokers, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	var msgs []*message.Message
	for i := 0; i < 4; i++ {
		m, err := marshaler.NewMessage("order.placed", map[string]int{"n": i})
		require.NoError(t, err)
		msgs = append(msgs, m)
	}
	poison := msgs[0].UUID
	require.NoError(t, pub.Publish(twoConsTopic, msgs...))

	var dead, deadFrom []string
	collect := func() {
		for {
			select {
			case rec := <-dlqc.Messages():
				m, err := kafka.Marshaler{}.Unmarshal(rec)
				require.NoError(t, err)
				dead = append(dead, m.UUID)
				deadFrom = append(deadFrom, m.Metadata.Get("reason_poisoned")[:min(60, len(m.Metadata.Get("reason_poisoned")))]+" by "+m.Metadata.Get("handler_poisoned"))
			default:
				return
			}
		}
	}
	count := func(q string) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, q).Scan(&n))
		return n
	}
	deaths := 0
	for finished := false; !finished; {
		if deaths > 2*middleware.DefaultMaxCrashes+1 {
			t.Fatalf("%d deaths and not finished", deaths)
		}
		out := &lockedBuffer{}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), twoConsChildEnv+"=1", "CRASHLOOP_SCHEMA="+schema, "CRASHLOOP_POISON="+poison,
			"CRASHLOOP_KAFKA_BROKERS="+strings.Join(brokers, ","))
		cmd.Stdout, cmd.Stderr = out, out
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
				deaths++
				break wait
			case <-time.After(200 * time.Millisecond):
				collect()
				// Done: each consumer dead-lettered the poison and applied the 3 others.
				if len(dead) >= 2 && count(`SELECT count(*) FROM effect`) >= 6 {
					_ = cmd.Process.Kill()
					<-exited
					finished = true
					break wait
				}
				if time.Now().After(deadline) {
					_ = cmd.Process.Kill()
					<-exited
					t.Fatalf("child neither crashed nor finished; output:\n%s", out.String())
				}
			}
		}
	}
	collect()
	t.Logf("%d process deaths, %d dead letters: %q", deaths, len(dead), deadFrom)
	for _, id := range dead {
		require.Equal(t, poison, id, "only the poison is dead-lettered: %q", deadFrom)
	}
	require.GreaterOrEqual(t, len(dead), 2, "each consumer dead-letters the poison")
	require.Equal(t, 6, count(`SELECT count(*) FROM effect`), "each other record applied once per consumer")
	require.LessOrEqual(t, deaths, 2*middleware.DefaultMaxCrashes,
		"the process was killed %d times by one record (MaxCrashes %d for each of 2 consumers)", deaths, middleware.DefaultMaxCrashes)
}
