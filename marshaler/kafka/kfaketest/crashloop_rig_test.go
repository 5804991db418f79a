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

// crashRig is what the crash-loop tests' member processes share with the
// test: a kfake cluster with the topic (partitions partitions) and its
// dead-letter topic, a schema migrated for the consumer with the tables of
// ddl, a publisher of new events and a reader of the dead letters.
type crashRig struct {
	t       *testing.T
	ctx     context.Context
	brokers []string
	pool    *pgxpool.Pool
	schema  string
	topic   string
	pub     *wmkafka.Publisher
	dlq     sarama.PartitionConsumer
	msgs    []*message.Message // every event published, in order
}

func newCrashRig(t *testing.T, partitions int32, topic, dlqTopic, ddl string) *crashRig {
	t.Helper()
	r := &crashRig{t: t, ctx: context.Background(), topic: topic}
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic), kfake.SeedTopics(1, dlqTopic))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	r.brokers = c.ListenAddrs()
	consumer, err := sarama.NewConsumer(r.brokers, crashLoopSaramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = consumer.Close() })
	r.dlq, err = consumer.ConsumePartition(dlqTopic, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.dlq.Close() })
	r.pool, r.schema = testenv.Pool(t)
	require.NoError(t, processed.Migrate(r.ctx, idempotency.Pgx(r.pool), processed.Config{}))
	_, err = r.pool.Exec(r.ctx, ddl)
	require.NoError(t, err)
	r.pub, err = crashLoopPublisher(r.brokers, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.pub.Close() })
	return r
}

// publish publishes n new events and returns their ids.
func (r *crashRig) publish(n int) []string {
	r.t.Helper()
	var batch []*message.Message
	var ids []string
	for i := 0; i < n; i++ {
		m, err := marshaler.NewMessage("order.placed", map[string]int{"n": len(r.msgs)})
		require.NoError(r.t, err)
		r.msgs = append(r.msgs, m)
		batch = append(batch, m)
		ids = append(ids, m.UUID)
	}
	require.NoError(r.t, r.pub.Publish(r.topic, batch...))
	return ids
}

// deadLetters returns the dead letters published since the last call.
func (r *crashRig) deadLetters() []*message.Message {
	var out []*message.Message
	for {
		select {
		case rec := <-r.dlq.Messages():
			m, err := kafka.Marshaler{}.Unmarshal(rec)
			require.NoError(r.t, err)
			out = append(out, m)
		default:
			return out
		}
	}
}

// count is the integer a query returns.
func (r *crashRig) count(q string, args ...any) int {
	r.t.Helper()
	var n int
	require.NoError(r.t, r.pool.QueryRow(r.ctx, q, args...).Scan(&n))
	return n
}

// crashCounts are the crash counts left, "<event id>: <started>", the
// poison's named so.
func (r *crashRig) crashCounts(poison string) []string {
	r.t.Helper()
	var out []string
	rows, err := r.pool.Query(r.ctx, `SELECT event_id::text, started FROM processed_event_crash`)
	require.NoError(r.t, err)
	defer rows.Close()
	for rows.Next() {
		var id string
		var n int
		require.NoError(r.t, rows.Scan(&id, &n))
		if id == poison {
			id = "poison"
		}
		out = append(out, fmt.Sprintf("%s: %d", id, n))
	}
	require.NoError(r.t, rows.Err())
	return out
}

// crashMember is a member process: the test binary started again with env,
// the rig's schema and brokers (CRASHLOOP_SCHEMA, CRASHLOOP_KAFKA_BROKERS).
type crashMember struct {
	cmd    *exec.Cmd
	out    *lockedBuffer
	exited chan struct{}
}

func (r *crashRig) start(env ...string) *crashMember {
	r.t.Helper()
	m := &crashMember{out: &lockedBuffer{}, exited: make(chan struct{})}
	m.cmd = exec.Command(os.Args[0], "-test.run=^$")
	m.cmd.Env = append(append(os.Environ(), "CRASHLOOP_SCHEMA="+r.schema, "CRASHLOOP_KAFKA_BROKERS="+strings.Join(r.brokers, ",")), env...)
	m.cmd.Stdout, m.cmd.Stderr = m.out, m.out
	require.NoError(r.t, m.cmd.Start())
	go func() { _ = m.cmd.Wait(); close(m.exited) }()
	r.t.Cleanup(func() { m.stop() })
	return m
}

// stop kills the member (if it still runs) and waits for it.
func (m *crashMember) stop() {
	_ = m.cmd.Process.Kill()
	<-m.exited
}

// requireKilled fails the test unless the member, which has exited, died
// by SIGKILL (its handler's death), not an error of its own.
func (m *crashMember) requireKilled(t *testing.T) {
	t.Helper()
	ws := m.cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("member ended with %s; output:\n%s", m.cmd.ProcessState, m.out.String())
	}
}

// memberMain runs this test binary as a member process when env is set
// (crashRig.start), with env's value, and exits: 2 when run fails, 3 when
// it returns (a member is expected to die by SIGKILL).
func memberMain(env string, run func(value string) error) {
	v := os.Getenv(env)
	if v == "" {
		return
	}
	if err := run(v); err != nil {
		fmt.Fprintln(os.Stderr, env, "member:", err)
		os.Exit(2)
	}
	os.Exit(3)
}

// memberDeps is what a member process opens from the environment start
// gave it: its pool on the rig's schema, the brokers and a publisher for
// its dead letters.
func memberDeps(logger watermill.LoggerAdapter) (*pgxpool.Pool, []string, *wmkafka.Publisher, error) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return nil, nil, nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("CRASHLOOP_SCHEMA")
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	brokers := strings.Split(os.Getenv("CRASHLOOP_KAFKA_BROKERS"), ",")
	dlq, err := crashLoopPublisher(brokers, logger)
	if err != nil {
		return nil, nil, nil, err
	}
	return pool, brokers, dlq, nil
}

// crashMemberSpec is one member process's consumers (runCrashMember).
type crashMemberSpec struct {
	topic, dlqTopic string
	// consumers are the consumer names: each is its own consumer group of
	// topic and its own handler, named after it.
	consumers []string
	retry     middleware.RetryConfig
	logger    watermill.LoggerAdapter
	// handle is the handler of consumer, on the member's pool.
	handle func(consumer string, pool *pgxpool.Pool) message.NoPublishHandlerFunc
}

// runCrashMember runs m's consumers through middleware.NewConsumer (dead
// letters on m.dlqTopic) on one router until SIGTERM.
func runCrashMember(m crashMemberSpec) error {
	pool, brokers, dlq, err := memberDeps(m.logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, m.logger)
	if err != nil {
		return err
	}
	for _, name := range m.consumers {
		sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
			Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: name,
			OverwriteSaramaConfig: crashLoopSaramaConfig(), ReconnectRetrySleep: 100 * time.Millisecond,
		}, m.logger)
		if err != nil {
			return err
		}
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer: name, DB: idempotency.Pgx(pool),
			Poison: middleware.PoisonConfig{Publisher: dlq, Topic: m.dlqTopic},
			Retry:  m.retry,
		}, m.logger)
		if err != nil {
			return err
		}
		if _, err := c.AddConsumerHandler(router, name, m.topic, sub, m.handle(name, pool)); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	return router.Run(ctx)
}
