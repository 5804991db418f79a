package kfaketest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The crash loop as it happens in production: the poisoned record reaches a
// member right after it applied the records before it in its partition (70
// here, past its first 64 attempts), not only duplicates as in
// TestCrashLoopOnKafkaBoundedWhenThePoisonReachesAWarmConsumer. That
// member does not count its first crash, so at most MaxCrashes+1 members
// die (docs/transports.md: "MaxCrashes+2 when it first reached a member
// past its first 64 attempts right after the record before it").
func TestCrashLoopOnKafkaBoundedWhenThePoisonFollowsNewEvents(t *testing.T) {
	// The first member, past its first 64 attempts, handled the record
	// before the poisoned one: its crash is not counted.
	runKafkaCrashLoop(t, kafkaCrashLoop{partitions: 1, before: 70, allowed: middleware.DefaultMaxCrashes + 1})
}

// The same under a steady producer on a topic with many partitions (256,
// one member owning all of them): each restarted member receives the first
// uncommitted record of every partition at once, and the poisoned one,
// the first record of its partition, is behind the records of up to 255
// others. It is counted all the same (its partition's first record after a
// start), while the records in flight beside it when it kills the member
// are not counted with it (counted attempts run one at a time) although
// they are the first ones again after each restart. guarantees.md: the
// broker's count is not taken as the crash count because that
// "dead-letters those innocent neighbours"; transports.md (Kafka): "Each
// event is applied once, the poison dead-lettered once". Each child gets
// 512 new records published before it starts. A count of a start's first
// 64 attempts let the poisoned record kill 5 members here.
func TestCrashLoopOnKafkaDeadLettersOnlyThePoisonUnderLoadOnManyPartitions(t *testing.T) {
	runKafkaCrashLoop(t, kafkaCrashLoop{partitions: 256, perChild: 512, allowed: middleware.DefaultMaxCrashes})
}

// kafkaCrashLoop is a crash loop run by runKafkaCrashLoop: a topic of
// partitions partitions; before records, then the poisoned one, then 3
// more, published before the first member starts, and perChild more before
// each member; a member is the test binary started with childEnv=1 (the
// crashlooptest child consuming crashLoopTopic by default); at most allowed
// members may die before the dead letter.
type kafkaCrashLoop struct {
	partitions       int32
	before, perChild int
	allowed          int
	childEnv         string // default "CRASHLOOP_CHILD"
	topic, dlq       string // default crashLoopTopic, crashLoopDLQ
}

// runKafkaCrashLoop starts members one after the other, each killed by the
// poisoned record (SIGKILL in its handler), until every record is applied
// or dead-lettered; then exactly the poisoned one must be dead-lettered,
// after at most cl.allowed deaths.
func runKafkaCrashLoop(t *testing.T, cl kafkaCrashLoop) {
	if cl.childEnv == "" {
		cl.childEnv = "CRASHLOOP_CHILD"
	}
	if cl.topic == "" {
		cl.topic, cl.dlq = crashLoopTopic, crashLoopDLQ
	}
	ctx := context.Background()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(cl.partitions, cl.topic), kfake.SeedTopics(1, cl.dlq))
	require.NoError(t, err)
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()

	consumer, err := sarama.NewConsumer(brokers, crashLoopSaramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = consumer.Close() })
	dlq, err := consumer.ConsumePartition(cl.dlq, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	t.Cleanup(func() { _ = dlq.Close() })

	pool, schema := testenv.Pool(t)
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL)`)
	require.NoError(t, err)

	var msgs []*message.Message
	pub, err := crashLoopPublisher(brokers, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	publish := func(n int) {
		var batch []*message.Message
		for i := 0; i < n; i++ {
			m, err := marshaler.NewMessage("order.placed", map[string]int{"n": len(msgs)})
			require.NoError(t, err)
			msgs = append(msgs, m)
			batch = append(batch, m)
		}
		require.NoError(t, pub.Publish(cl.topic, batch...))
	}
	publish(cl.before + 1)
	poison := msgs[cl.before].UUID
	publish(3)

	var dead []string
	collect := func() {
		for {
			select {
			case rec := <-dlq.Messages():
				m, err := kafka.Marshaler{}.Unmarshal(rec)
				require.NoError(t, err)
				dead = append(dead, m.UUID)
			default:
				return
			}
		}
	}
	counts := func() []string {
		var out []string
		rows, err := pool.Query(ctx, `SELECT event_id::text, started FROM processed_event_crash`)
		require.NoError(t, err)
		for rows.Next() {
			var id string
			var n int
			require.NoError(t, rows.Scan(&id, &n))
			if id == poison {
				id = "poison"
			}
			out = append(out, fmt.Sprintf("%s: %d", id, n))
		}
		require.NoError(t, rows.Err())
		return out
	}
	crashes := 0
	for finished := false; !finished; {
		if crashes > cl.allowed+2 {
			t.Fatalf("the poisoned record killed %d members (%d allowed) and was not dead-lettered; crash counts %v", crashes, cl.allowed, counts())
		}
		if cl.perChild > 0 {
			publish(cl.perChild) // the producers do not stop while members crash
		}
		var out strings.Builder
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), cl.childEnv+"=1", "CRASHLOOP_SCHEMA="+schema, "CRASHLOOP_POISON="+poison,
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
				// Done when every record is accounted for: applied or
				// dead-lettered (the assertions below say which).
				if len(dead) > 0 && applied+len(dead) >= len(msgs) {
					_ = cmd.Process.Kill()
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
	t.Logf("%d crashes, %d dead letters", crashes, len(dead))
	require.Equal(t, []string{poison}, dead, "only the poisoned record is dead-lettered; the others, which killed nothing, are applied")
	require.LessOrEqual(t, crashes, cl.allowed, "members killed by the poisoned record before its dead letter (%d allowed)", cl.allowed)
}
