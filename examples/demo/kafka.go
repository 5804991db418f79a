package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-idempotency/idempotency/examples/shop"
)

// backendKafka is PostgreSQL (DATABASE_URL) and an in-process
// Kafka-protocol cluster (kfake, run by the program kafkapeer, which the
// demo builds and starts): the shop's services on shop.KafkaTransport,
// nothing to install beyond PostgreSQL.
const backendKafka = "kafka"

// kafkaBroker is the demo's broker on Kafka: a kafkapeer child process,
// the run's topics, and a Sarama client for the inspection.
type kafkaBroker struct {
	d      *demo
	t      shop.KafkaTransport
	pub    message.Publisher
	client sarama.Client
	admin  sarama.ClusterAdmin
	raw    sarama.SyncProducer
	mu     sync.Mutex
	subs   map[string]*shop.KafkaSubscriber // by consumer name, once its service created it
	dlqEnd map[string]map[int32]int64       // drainDeadLetters: where the next drain starts
}

func (d *demo) newKafkaBroker(all []shop.Consumer) (*kafkaBroker, error) {
	brokers, err := d.startKafkaPeer()
	if err != nil {
		return nil, err
	}
	b := &kafkaBroker{d: d, t: shop.KafkaTransport{Brokers: brokers, Prefix: "demo_" + d.id},
		subs: map[string]*shop.KafkaSubscriber{}, dlqEnd: map[string]map[int32]int64{}}
	if b.client, err = sarama.NewClient(brokers, b.t.SaramaConfig()); err != nil {
		return nil, fmt.Errorf("Kafka at %s: %w", strings.Join(brokers, ","), err)
	}
	d.defer_(func() { _ = b.client.Close() })
	if b.admin, err = sarama.NewClusterAdminFromClient(b.client); err != nil {
		return nil, err
	}
	if err := b.t.Declare(b.admin, all...); err != nil {
		return nil, err
	}
	if b.raw, err = sarama.NewSyncProducerFromClient(b.client); err != nil {
		return nil, err
	}
	d.defer_(func() { _ = b.raw.Close() })
	if b.pub, err = b.t.EventsPublisher(d.logger); err != nil {
		return nil, fmt.Errorf("relay publisher: %w", err)
	}
	d.defer_(func() { _ = b.pub.Close() })
	return b, nil
}

// startKafkaPeer builds examples/demo/kafkapeer (a module of its own, Go
// 1.26: see its doc comment) with the go command, from the demo's source
// directory, starts it, and returns the brokers' addresses it prints. The
// peer serves until its standard input is closed: at the end of the run, or
// when the demo dies.
func (d *demo) startKafkaPeer() ([]string, error) {
	_, file, _, ok := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "kafkapeer")
	if _, err := os.Stat(filepath.Join(src, "go.mod")); !ok || err != nil {
		return nil, fmt.Errorf("-backend kafka builds its Kafka from the demo's source (examples/demo/kafkapeer), not found at %s: run the demo with go run from the repository", src)
	}
	dir, err := os.MkdirTemp("", "watermill-idempotency-kafkapeer-")
	if err != nil {
		return nil, err
	}
	d.defer_(func() { _ = os.RemoveAll(dir) })
	bin := filepath.Join(dir, "kafkapeer")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building the Kafka peer (cd %s && go build): %w\n%s", src, err, out)
	}
	peer := exec.Command(bin)
	peer.Stderr = d.stderr
	stdin, err := peer.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := peer.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := peer.Start(); err != nil {
		return nil, fmt.Errorf("starting the Kafka peer: %w", err)
	}
	d.defer_(func() {
		_ = stdin.Close() // the peer's end: it closes its cluster and exits
		done := make(chan struct{})
		go func() { _ = peer.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = peer.Process.Kill()
			<-done
		}
	})
	line := make(chan string, 1)
	go func() {
		in := bufio.NewScanner(stdout)
		if in.Scan() {
			line <- in.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	select {
	case l, ok := <-line:
		if addrs, found := strings.CutPrefix(l, "kafka "); ok && found && addrs != "" {
			return strings.Split(addrs, ","), nil
		}
		return nil, fmt.Errorf("the Kafka peer printed %q, not its addresses", l)
	case <-time.After(30 * time.Second):
		return nil, errors.New("the Kafka peer did not print its addresses within 30 s")
	}
}

func (b *kafkaBroker) publisher() message.Publisher { return b.pub }

// kafkaTransport records the subscriber its service creates, for cut.
type kafkaTransport struct {
	shop.KafkaTransport
	b *kafkaBroker
}

func (t kafkaTransport) Subscriber(c shop.Consumer, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	sub, err := t.KafkaTransport.Subscriber(c, logger)
	if err == nil {
		t.b.mu.Lock()
		t.b.subs[c.Name] = sub.(*shop.KafkaSubscriber)
		t.b.mu.Unlock()
	}
	return sub, err
}

// transport is c's Kafka, and cut restarts c's subscriber: its members
// leave the groups before the acks in flight reach them (their offsets are
// not committed), and the partitions are consumed again from the last
// committed offset on a new session.
func (b *kafkaBroker) transport(c shop.Consumer) (shop.Transport, func(), error) {
	return kafkaTransport{KafkaTransport: b.t, b: b}, func() {
		b.mu.Lock()
		sub := b.subs[c.Name]
		b.mu.Unlock()
		if sub != nil {
			sub.Restart()
		}
	}, nil
}

// publishRaw produces body as is on the topic of the event name key, with
// id as its Watermill UUID header.
func (b *kafkaBroker) publishRaw(_ context.Context, key, id string, body []byte) error {
	_, _, err := b.raw.SendMessage(&sarama.ProducerMessage{
		Topic: b.t.Topic(key), Value: sarama.ByteEncoder(body),
		Headers: []sarama.RecordHeader{{Key: []byte(wmkafka.UUIDHeaderKey), Value: []byte(id)}},
	})
	return err
}

// queued is the records of c's topics past its groups' committed offsets.
func (b *kafkaBroker) queued(c shop.Consumer) (int, error) {
	total := 0
	for _, ev := range c.Bindings {
		topic := b.t.Topic(ev)
		parts, err := b.client.Partitions(topic)
		if err != nil {
			return 0, err
		}
		res, err := b.admin.ListConsumerGroupOffsets(b.t.Group(c, ev), map[string][]int32{topic: parts})
		if err != nil {
			return 0, err
		}
		for _, p := range parts {
			end, err := b.client.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				return 0, err
			}
			committed := int64(0)
			if blk := res.GetBlock(topic, p); blk != nil && blk.Offset >= 0 {
				committed = blk.Offset
			}
			total += int(max(end-committed, 0))
		}
	}
	return total, nil
}

// records calls each with every record of topic from the offsets in from
// (the start when absent), and returns the end offsets.
func (b *kafkaBroker) records(topic string, from map[int32]int64, each func(*sarama.ConsumerMessage)) (map[int32]int64, error) {
	consumer, err := sarama.NewConsumerFromClient(b.client)
	if err != nil {
		return nil, err
	}
	defer consumer.Close()
	parts, err := b.client.Partitions(topic)
	if err != nil {
		return nil, err
	}
	ends := map[int32]int64{}
	for _, p := range parts {
		end, err := b.client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, err
		}
		ends[p] = end
		start := from[p]
		if start >= end {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, start)
		if err != nil {
			return nil, err
		}
		for rec := range pc.Messages() {
			each(rec)
			if rec.Offset+1 >= end {
				break
			}
		}
		if err := pc.Close(); err != nil {
			return nil, err
		}
	}
	return ends, nil
}

func header(rec *sarama.ConsumerMessage, key string) string {
	for _, h := range rec.Headers {
		if h != nil && string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

// drainDeadLetters reads c's dead-letter topic past the previous drain.
func (b *kafkaBroker) drainDeadLetters(c shop.Consumer) (dlqContent, error) {
	got := dlqContent{byID: map[string]int{}, withReason: map[string]int{}}
	ends, err := b.records(b.t.DeadLetterTopic(c), b.dlqEnd[c.Name], func(rec *sarama.ConsumerMessage) {
		id := header(rec, wmkafka.UUIDHeaderKey)
		got.total++
		got.byID[id]++
		if header(rec, wmw.ReasonForPoisonedKey) != "" {
			got.withReason[id]++
		}
	})
	if err == nil {
		b.dlqEnd[c.Name] = ends
	}
	return got, err
}

// reconciling is the number of records of c's reconciliation topic.
func (b *kafkaBroker) reconciling(c shop.Consumer) (int, error) {
	n := 0
	_, err := b.records(b.t.ReconcileTopic(c), nil, func(*sarama.ConsumerMessage) { n++ })
	return n, err
}
