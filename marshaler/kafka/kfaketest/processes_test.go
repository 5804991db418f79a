package kfaketest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
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
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

// The consumer processes of TestKafkaConsumerProcessesApplyEachEventOnce:
// the test binary run again as TestKafkaMemberProcess with these variables.
const (
	envMember  = "KFAKETEST_MEMBER"  // the member's name; set only in a child
	envBrokers = "KFAKETEST_BROKERS" // kfake's listen addresses, comma-separated
	envSchema  = "KFAKETEST_SCHEMA"  // the PostgreSQL schema of the tables
)

const (
	loadTopic  = "orders"
	deadTopic  = "orders_dead"
	loadGroup  = "stock"
	partitions = 4
)

// processSaramaConfig is the members' Sarama configuration against kfake.
// Offsets are marked by watermill-kafka at each ack and committed by
// Sarama's auto-commit every 200 ms (and when a session ends): what a member
// has not acked is never committed and is consumed again by the next owner
// of its partition; what was marked but not yet committed when a member dies
// is consumed again too, and the claim skips it. With AutoCommit off,
// watermill-kafka commits synchronously at each ack, and Sarama sends that
// commit on the partition leader's connection (here the coordinator too)
// behind a fetch that waits up to Consumer.MaxWaitTime (500 ms) for data: a
// member then applied about two events per second per connection once its
// partitions had caught up with the producer (measured on this test). The
// session timeout is kfake's (and Kafka's) minimum, 6 s: a SIGKILLed member
// leaves the group when it expires.
func processSaramaConfig() *sarama.Config {
	c := saramaConfig()
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 5 * time.Second
	return c
}

// TestKafkaMemberProcess is one consumer process of
// TestKafkaConsumerProcessesApplyEachEventOnce; run directly it does nothing.
// It consumes loadTopic in group loadGroup through middleware.NewConsumer,
// records each delivery (autocommit, outside the attempt) and applies each
// event (a row in effect, in the attempt's transaction). A line "hold" on
// stdin arms the named crash point: the next delivery whose effect
// committed prints "HELD <event id>" and blocks before its ack, so before
// watermill-kafka commits its offset; the parent then SIGKILLs the process.
func TestKafkaMemberProcess(t *testing.T) {
	name := os.Getenv(envMember)
	if name == "" {
		return
	}
	if err := runMember(name, strings.Split(os.Getenv(envBrokers), ","), os.Getenv(envSchema)); err != nil {
		fmt.Fprintln(os.Stderr, "member:", err)
		os.Exit(2)
	}
	os.Exit(0)
}

func runMember(name string, brokers []string, schema string) error {
	ctx := context.Background()
	logger := watermill.LoggerAdapter(watermill.NopLogger{})
	if os.Getenv("KFAKE_DEBUG") != "" {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, true, os.Getenv("KFAKE_DEBUG") == "trace")
	}
	pc, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return err
	}
	pc.ConnConfig.RuntimeParams["search_path"] = schema
	pc.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return err
	}
	defer pool.Close()
	pubCfg := wmkafka.DefaultSaramaSyncPublisherConfig()
	pubCfg.Version = sarama.V2_1_0_0
	poison, err := wmkafka.NewPublisher(wmkafka.PublisherConfig{
		Brokers: brokers, Marshaler: kafka.Marshaler{}, OverwriteSaramaConfig: pubCfg,
	}, logger)
	if err != nil {
		return err
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: loadGroup,
		DB:       idempotency.Pgx(pool),
		Poison:   middleware.PoisonConfig{Publisher: poison, Topic: deadTopic},
		Retry:    middleware.RetryConfig{MaxRetries: 2, InitialInterval: 10 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
	}, logger)
	if err != nil {
		return err
	}
	sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
		Brokers: brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: loadGroup,
		OverwriteSaramaConfig: processSaramaConfig(), ReconnectRetrySleep: 100 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}

	var armed atomic.Bool
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			if in.Text() == "hold" {
				armed.Store(true)
			}
		}
	}()
	var applied sync.Map // event ids whose handler ran in this process
	var held sync.Once
	// Outside the consumer's chain (router level, added first).
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if _, bad := marshaler.Malformed(msg); !bad {
				if _, err := pool.Exec(msg.Context(), `INSERT INTO delivery (event_id, member) VALUES ($1, $2)`, msg.UUID, name); err != nil {
					return nil, err
				}
			}
			out, err := h(msg)
			if _, ran := applied.Load(msg.UUID); err == nil && ran && armed.Load() {
				held.Do(func() {
					fmt.Printf("HELD %s\n", msg.UUID) // the effect committed; the ack, hence the offset commit, never comes
					select {}
				})
			}
			return out, err
		}
	})
	if _, err := c.AddConsumerHandler(router, "apply", loadTopic, sub, func(msg *message.Message) error {
		tx, ok := middleware.PgxTxFromContext(msg.Context())
		if !ok {
			return fmt.Errorf("no transaction")
		}
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, member) VALUES ($1, $2)`, msg.UUID, name); err != nil {
			return err
		}
		applied.Store(msg.UUID, true)
		time.Sleep(2 * time.Millisecond) // the handler's work: deliveries stay in flight while the group changes
		return nil
	}); err != nil {
		return err
	}
	return router.Run(ctx)
}

// member is a running consumer process.
type member struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	held   chan string // the event id of the HELD line
	stderr *lockedBuffer
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func startMember(t *testing.T, name string, brokers []string, schema string) *member {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKafkaMemberProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), envMember+"="+name, envBrokers+"="+strings.Join(brokers, ","), envSchema+"="+schema)
	m := &member{name: name, cmd: cmd, held: make(chan string, 1), stderr: &lockedBuffer{}}
	cmd.Stderr = m.stderr
	if d := os.Getenv("KFAKETEST_LOGDIR"); d != "" { // with KFAKE_DEBUG: each member's log in <dir>/<name>.log
		f, err := os.Create(filepath.Join(d, name+".log"))
		require.NoError(t, err)
		cmd.Stderr = io.MultiWriter(m.stderr, f)
	}
	var err error
	m.stdin, err = cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		in := bufio.NewScanner(stdout)
		for in.Scan() {
			if id, ok := strings.CutPrefix(in.Text(), "HELD "); ok {
				m.held <- id
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() && os.Getenv("KFAKETEST_LOGDIR") == "" {
			t.Logf("member %s stderr:\n%s", name, m.stderr.String())
		}
	})
	return m
}

// TestKafkaConsumerProcessesApplyEachEventOnce runs three consumer processes
// (each a watermill-kafka consumer-group member through
// middleware.NewConsumer) on one kfake cluster and one PostgreSQL schema
// while events are published without pause: a foreign record (poison), a
// produce whose response is lost (kfake answers REQUEST_TIMED_OUT after
// appending, Sarama retries: the record is stored twice), a member joining
// while the others process (a rebalance), and a member SIGKILLed at a named
// point after its effect committed and before its offset commit (its
// partitions move after the session timeout and the event is delivered
// again). From the database: every event applied exactly once, the held
// event and the twice-stored one delivered at least twice, the poison
// dead-lettered once, and every partition's committed offset at its end (no
// partition blocked).
func TestKafkaConsumerProcessesApplyEachEventOnce(t *testing.T) {
	t.Parallel()
	cl, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, loadTopic), kfake.SeedTopics(1, deadTopic))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	brokers := cl.ListenAddrs()
	pool, schema := testenv.Pool(t)
	ctx := context.Background()
	require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL, member text NOT NULL);
		CREATE TABLE delivery (event_id uuid NOT NULL, member text NOT NULL)`)
	require.NoError(t, err)
	count := func(q string, args ...any) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, q, args...).Scan(&n))
		return n
	}

	raw, err := sarama.NewSyncProducer(brokers, func() *sarama.Config {
		c := sarama.NewConfig()
		c.Version = sarama.V2_1_0_0
		c.Producer.Return.Successes = true
		return c
	}())
	require.NoError(t, err)
	t.Cleanup(func() { _ = raw.Close() })
	pub := newPublisher(t, brokers)

	// The publisher: events keyed over every partition, without pause
	// until stop is closed; the 10th record is a foreign one, the 20th
	// event's produce loses its response once.
	var (
		mu      sync.Mutex
		ids     []string
		twice   string
		poisonP int32
		poisonO int64
	)
	published := func() int { mu.Lock(); defer mu.Unlock(); return len(ids) }
	stop := make(chan struct{})
	pubDone := make(chan error, 1)
	publish := func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				pubDone <- nil
				return
			default:
			}
			if i == 10 {
				p, o, err := raw.SendMessage(&sarama.ProducerMessage{Topic: loadTopic, Key: sarama.StringEncoder("k3"), Value: sarama.StringEncoder("not an envelope")})
				if err != nil {
					pubDone <- err
					return
				}
				mu.Lock()
				poisonP, poisonO = p, o
				mu.Unlock()
			}
			msg, err := marshaler.NewMessage("order.placed", map[string]int{"i": i})
			if err != nil {
				pubDone <- err
				return
			}
			msg.Metadata.Set("key", fmt.Sprintf("k%d", i%16))
			if i == 20 {
				cl.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: loadTopic, Err: kerr.RequestTimedOut, Count: 1})
				mu.Lock()
				twice = msg.UUID
				mu.Unlock()
			}
			if err := pub.Publish(loadTopic, msg); err != nil {
				pubDone <- err
				return
			}
			mu.Lock()
			ids = append(ids, msg.UUID)
			mu.Unlock()
			time.Sleep(5 * time.Millisecond) // pacing: the load lasts through every fault below
		}
	}
	t.Cleanup(func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
	})

	admin, err := sarama.NewClusterAdmin(brokers, saramaConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	committed := func(p int32) int64 {
		res, err := admin.ListConsumerGroupOffsets(loadGroup, map[string][]int32{loadTopic: {p}})
		if err != nil {
			return -1
		}
		if b := res.GetBlock(loadTopic, p); b != nil {
			return b.Offset
		}
		return -1
	}
	const wait = 2 * time.Minute

	members := map[string]*member{}
	for _, name := range []string{"a", "b"} {
		members[name] = startMember(t, name, brokers, schema)
	}
	// The load starts once a and b form the group: the poison record is not
	// in flight during their joining rebalance (a partition moving between
	// its dead-letter publish and its ack would dead-letter it twice; see
	// docs/transports.md).
	testenv.Eventually(t, wait, "a and b in the group", func(o *testenv.Observed) bool {
		groups, err := admin.DescribeConsumerGroups([]string{loadGroup})
		if !o.Err("describe", err) || len(groups) != 1 {
			return false
		}
		return o.Str("state", groups[0].State) == "Stable" && o.Int("members", len(groups[0].Members)) == 2
	})
	go publish()

	// 1. The poison record is dead-lettered and its offset committed.
	testenv.Eventually(t, wait, "the poison record dead-lettered and committed past", func(o *testenv.Observed) bool {
		mu.Lock()
		p, off := poisonP, poisonO
		mu.Unlock()
		return o.Int("published", published()) > 10 && o.Int("dead", len(records(t, brokers, deadTopic))) >= 1 &&
			testenv.See(o, "committed", committed(p)) > off
	})

	// 2. A member joins while events are in flight: a rebalance.
	members["c"] = startMember(t, "c", brokers, schema)
	testenv.Eventually(t, wait, "the joining member applies events", func(o *testenv.Observed) bool {
		return o.Int("applied by c", count(`SELECT count(*) FROM effect WHERE member = 'c'`)) > 0
	})

	// 3. b is held after an effect committed, before its offset commit,
	// and SIGKILLed there.
	_, err = io.WriteString(members["b"].stdin, "hold\n")
	require.NoError(t, err)
	var heldID string
	select {
	case heldID = <-members["b"].held:
	case <-time.After(wait):
		t.Fatalf("member b never reached its crash point; stderr:\n%s", members["b"].stderr.String())
	}
	require.Equal(t, 1, count(`SELECT count(*) FROM effect WHERE event_id = $1`, heldID), "the held event's effect committed")
	require.NoError(t, members["b"].cmd.Process.Signal(syscall.SIGKILL))

	// 4. The load goes on past b's session timeout, then stops.
	killedAt := published()
	testenv.Eventually(t, wait, "more events published and applied after the kill", func(o *testenv.Observed) bool {
		return o.Int("delivered again", count(`SELECT count(*) FROM delivery WHERE event_id = $1 AND member <> 'b'`, heldID)) > 0 &&
			o.Int("published", published()) > killedAt+50
	})
	close(stop)
	require.NoError(t, <-pubDone)

	mu.Lock()
	all, dup := append([]string(nil), ids...), twice
	mu.Unlock()
	ends := highWaterMarks(t, brokers)
	testenv.Eventually(t, wait, "every event applied and every partition committed to its end", func(o *testenv.Observed) bool {
		done := o.Int("applied", count(`SELECT count(DISTINCT event_id) FROM effect`)) == o.Int("published", len(all))
		for p := int32(0); p < partitions; p++ {
			if testenv.See(o, fmt.Sprintf("committed[%d]", p), committed(p)) < testenv.See(o, fmt.Sprintf("end[%d]", p), ends[p]) {
				done = false
			}
		}
		return done
	})

	require.Equal(t, len(all), count(`SELECT count(*) FROM effect`), "an effect was applied twice")
	require.Equal(t, len(all), count(`SELECT count(*) FROM effect WHERE event_id = ANY($1::uuid[])`, all), "an effect of an unknown event")
	require.Equal(t, 1, count(`SELECT count(*) FROM effect WHERE event_id = $1`, heldID))
	require.GreaterOrEqual(t, count(`SELECT count(*) FROM delivery WHERE event_id = $1`, heldID), 2, "the held event was not delivered again")
	stored := 0
	for _, rec := range records(t, brokers, loadTopic) {
		if rec == dup {
			stored++
		}
	}
	require.Equal(t, 2, stored, "the produce retried after its lost response stored the record twice")
	require.GreaterOrEqual(t, count(`SELECT count(*) FROM delivery WHERE event_id = $1`, dup), 2, "both copies delivered")
	require.Len(t, records(t, brokers, deadTopic), 1, "the poison record dead-lettered once")
}

// records returns the Watermill UUID of every record of topic (the event
// id; for a record without one, its topic/partition/offset).
func records(t *testing.T, brokers []string, topic string) []string {
	t.Helper()
	client, err := sarama.NewClient(brokers, saramaConfig())
	require.NoError(t, err)
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	require.NoError(t, err)
	defer consumer.Close()
	parts, err := client.Partitions(topic)
	require.NoError(t, err)
	var out []string
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		if end == 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		for rec := range pc.Messages() {
			msg, err := kafka.Marshaler{}.Unmarshal(rec)
			require.NoError(t, err)
			out = append(out, msg.UUID)
			if rec.Offset+1 >= end {
				break
			}
		}
		require.NoError(t, pc.Close())
	}
	return out
}

// highWaterMarks returns the next offset of each partition of loadTopic.
func highWaterMarks(t *testing.T, brokers []string) map[int32]int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, saramaConfig())
	require.NoError(t, err)
	defer client.Close()
	out := map[int32]int64{}
	for p := int32(0); p < partitions; p++ {
		end, err := client.GetOffset(loadTopic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		out[p] = end
	}
	return out
}
