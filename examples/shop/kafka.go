package shop

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/marshaler/kafka"
)

// DefaultKafkaPartitions is the partition count of the topics
// KafkaTransport declares.
const DefaultKafkaPartitions = 4

// KafkaTransport is Kafka with the shop's layout, built on watermill-kafka
// v3 (Sarama) and marshaler/kafka:
//
//   - a topic per event name, Prefix+"."+<event name> (the exchange's
//     routing key becomes the topic);
//   - per consumer and bound event name a consumer group,
//     Prefix+"."+<name>+"."+<event name>: watermill-kafka subscribes to one
//     topic per Subscribe, and a group of its own per topic means that a
//     member joining one topic's group does not rebalance another's;
//   - per consumer a dead-letter topic and a reconciliation topic
//     (Prefix+".dlq."+<name>, Prefix+".reconcile."+<name>).
//
// Offsets are marked at each ack and committed by Sarama's auto-commit
// every 200 ms (watermill-kafka's synchronous commit at each ack waits
// behind a long-poll fetch; see docs/transports.md); the session timeout is
// Kafka's minimum, 6 s. Declare the topics with Declare before starting
// services.
type KafkaTransport struct {
	// Brokers are the bootstrap brokers ("127.0.0.1:9092"). Required.
	Brokers []string
	// Prefix names the topics and groups: letters, digits, '_', '-' and
	// '.'. Required.
	Prefix string
	// Partitions is the partition count of the topics Declare creates.
	// Defaults to DefaultKafkaPartitions.
	Partitions int32
}

var _ Transport = KafkaTransport{}

// Topic is the topic of the events named eventName.
func (t KafkaTransport) Topic(eventName string) string { return t.Prefix + "." + eventName }

// Group is c's consumer group on the topic of eventName.
func (t KafkaTransport) Group(c Consumer, eventName string) string {
	return t.Prefix + "." + c.Name + "." + eventName
}

// DeadLetterTopic is c's dead-letter topic.
func (t KafkaTransport) DeadLetterTopic(c Consumer) string { return t.Prefix + ".dlq." + c.Name }

// ReconcileTopic is c's reconciliation topic.
func (t KafkaTransport) ReconcileTopic(c Consumer) string { return t.Prefix + ".reconcile." + c.Name }

// SaramaConfig is the Sarama configuration of the transport's clients.
func (t KafkaTransport) SaramaConfig() *sarama.Config {
	c := wmkafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_1_0_0
	c.Producer.Return.Successes = true
	c.Producer.Retry.Backoff = 50 * time.Millisecond
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = true
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 5 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 100 * time.Millisecond
	c.Metadata.RefreshFrequency = time.Second
	return c
}

func (t KafkaTransport) partitions() int32 {
	if t.Partitions <= 0 {
		return DefaultKafkaPartitions
	}
	return t.Partitions
}

// topics returns the topics of the consumers: their bound event names',
// dead-letter and reconciliation topics.
func (t KafkaTransport) topics(consumers ...Consumer) ([]string, error) {
	if t.Prefix == "" || len(t.Brokers) == 0 {
		return nil, errors.New("shop: KafkaTransport.Prefix and Brokers are required")
	}
	seen := map[string]bool{}
	var out []string
	add := func(topic string) {
		if !seen[topic] {
			seen[topic] = true
			out = append(out, topic)
		}
	}
	for _, c := range consumers {
		if err := (Topology{}).Validate(c); err != nil { // the same naming rules
			return nil, err
		}
		for _, b := range c.Bindings {
			add(t.Topic(b))
		}
		add(t.DeadLetterTopic(c))
		add(t.ReconcileTopic(c))
	}
	return out, nil
}

// Declare creates, with admin, the topics of the consumers (Partitions
// partitions each, replication 1); a topic that exists is left as it is.
// A binding is an event name: Kafka has no topic patterns.
func (t KafkaTransport) Declare(admin sarama.ClusterAdmin, consumers ...Consumer) error {
	topics, err := t.topics(consumers...)
	if err != nil {
		return err
	}
	for _, topic := range topics {
		err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: t.partitions(), ReplicationFactor: 1}, false)
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("shop: create topic %s: %w", topic, err)
		}
	}
	return nil
}

// Delete removes the topics and consumer groups Declare and the
// subscribers created.
func (t KafkaTransport) Delete(admin sarama.ClusterAdmin, consumers ...Consumer) error {
	topics, err := t.topics(consumers...)
	if err != nil {
		return err
	}
	var errs []error
	for _, c := range consumers {
		for _, b := range c.Bindings {
			if err := admin.DeleteConsumerGroup(t.Group(c, b)); err != nil && !errors.Is(err, sarama.ErrGroupIDNotFound) {
				errs = append(errs, err)
			}
		}
	}
	for _, topic := range topics {
		if err := admin.DeleteTopic(topic); err != nil && !errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (t KafkaTransport) publisher(logger watermill.LoggerAdapter) (*wmkafka.Publisher, error) {
	return wmkafka.NewPublisher(wmkafka.PublisherConfig{
		Brokers: t.Brokers, Marshaler: kafka.Marshaler{}, OverwriteSaramaConfig: t.SaramaConfig(),
	}, logger)
}

// EventsPublisher implements Transport: the Watermill topic (the event
// name) is published on Topic(topic).
func (t KafkaTransport) EventsPublisher(logger watermill.LoggerAdapter) (message.Publisher, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, err
	}
	return prefixPublisher{pub: p, prefix: t.Topic}, nil
}

// PoisonPublisher implements Transport: a publisher whose topic is c's
// dead-letter topic.
func (t KafkaTransport) PoisonPublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.DeadLetterTopic(c), nil
}

// ReconcilePublisher implements Transport: a publisher whose topic is c's
// reconciliation topic.
func (t KafkaTransport) ReconcilePublisher(c Consumer, logger watermill.LoggerAdapter) (message.Publisher, string, error) {
	p, err := t.publisher(logger)
	if err != nil {
		return nil, "", err
	}
	return p, t.ReconcileTopic(c), nil
}

// Subscriber implements Transport: a *KafkaSubscriber of c's groups.
func (t KafkaTransport) Subscriber(c Consumer, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	if _, err := t.topics(c); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &KafkaSubscriber{t: t, c: c, logger: logger, closing: make(chan struct{}), session: 1}, nil
}

// KafkaSubscriber consumes, per Subscribe, each topic c binds as a member
// of its group (watermill-kafka subscribers, one per topic) and merges
// them into one channel; the topic given to Subscribe is ignored. The
// router gets a copy of each message, whose context keeps the values of
// watermill-kafka's (partition, offset), not its cancellation, and carries
// the session (SessionFromContext); its ack or nack is passed on to
// watermill-kafka unless the session was restarted since.
type KafkaSubscriber struct {
	t       KafkaTransport
	c       Consumer
	logger  watermill.LoggerAdapter
	closing chan struct{}
	once    sync.Once

	mu      sync.Mutex
	session uint64                   // 1, 2, …: the members' generation
	restart []chan struct{}          // one per open subscription
	members []*wmkafka.Subscriber    // of the current session
	wg      sync.WaitGroup           // the subscriptions' goroutines
	cut     map[uint64]chan struct{} // closed when that session was restarted
}

// Restart ends the current session: every member is closed before the
// acks of its deliveries in flight reach it (their offsets are never
// marked, so they are consumed again, with every marked offset not yet
// committed), and new members join the groups on a new session. It is
// what a consumer process that loses its connections, or crashes, before
// its offset commit does to its deliveries. It returns at once; the new
// members start once the old ones have left the groups.
func (s *KafkaSubscriber) Restart() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cut == nil {
		s.cut = map[uint64]chan struct{}{}
	}
	if ch, ok := s.cut[s.session]; ok {
		close(ch)
		delete(s.cut, s.session)
	}
	s.session++
	for _, r := range s.restart {
		select {
		case r <- struct{}{}:
		default: // a restart is already pending
		}
	}
}

// sessionCut returns the session number and the channel closed when it is
// restarted.
func (s *KafkaSubscriber) sessionCut() (uint64, chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cut == nil {
		s.cut = map[uint64]chan struct{}{}
	}
	ch, ok := s.cut[s.session]
	if !ok {
		ch = make(chan struct{})
		s.cut[s.session] = ch
	}
	return s.session, ch
}

// Subscribe opens a subscription: one member of each of c's groups, until
// ctx is done or the subscriber is closed.
func (s *KafkaSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	restart := make(chan struct{}, 1)
	s.mu.Lock()
	s.restart = append(s.restart, restart)
	s.mu.Unlock()
	out := make(chan *message.Message)
	first, err := s.join(ctx, out)
	if err != nil {
		return nil, err
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		members := first
		for {
			select {
			case <-restart:
				closeAll(members)
				for {
					if members, err = s.join(ctx, out); err == nil {
						break
					}
					s.logger.Error("kafka: cannot rejoin the groups", err, watermill.LogFields{"consumer": s.c.Name})
					select {
					case <-time.After(100 * time.Millisecond):
					case <-ctx.Done():
						return
					case <-s.closing:
						return
					}
				}
			case <-ctx.Done():
				closeAll(members)
				return
			case <-s.closing:
				closeAll(members)
				return
			}
		}
	}()
	return out, nil
}

// member is one session's watermill-kafka subscribers (one per bound
// topic: a Subscriber has one group) and the goroutines that forward their
// messages.
type member struct {
	subs []*wmkafka.Subscriber
	wg   *sync.WaitGroup
}

func closeAll(m member) {
	for _, sub := range m.subs {
		_ = sub.Close() // its channels close, the forwarders return
	}
	m.wg.Wait()
}

// join starts a session's members and forwards their messages to out.
func (s *KafkaSubscriber) join(ctx context.Context, out chan<- *message.Message) (member, error) {
	session, cut := s.sessionCut()
	m := member{wg: &sync.WaitGroup{}}
	for _, b := range s.c.Bindings {
		sub, err := wmkafka.NewSubscriber(wmkafka.SubscriberConfig{
			Brokers: s.t.Brokers, Unmarshaler: kafka.Marshaler{}, ConsumerGroup: s.t.Group(s.c, b),
			OverwriteSaramaConfig: s.t.SaramaConfig(), ReconnectRetrySleep: 100 * time.Millisecond,
		}, s.logger)
		if err != nil {
			closeAll(m)
			return member{}, err
		}
		m.subs = append(m.subs, sub)
		in, err := sub.Subscribe(ctx, s.t.Topic(b))
		if err != nil {
			closeAll(m)
			return member{}, err
		}
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			for msg := range in {
				s.forward(ctx, msg, out, session, cut)
			}
		}()
	}
	return m, nil
}

// forward hands a copy of msg to out and passes its ack or nack on to msg,
// unless the session was cut first: then msg is left unacked, and the
// member's close discards it (its offset is never marked). One message at a
// time per topic and subscription, as watermill-amqp hands deliveries over.
func (s *KafkaSubscriber) forward(ctx context.Context, msg *message.Message, out chan<- *message.Message, session uint64, cut <-chan struct{}) {
	select {
	case <-cut:
		return // the session is over: not handed to the router
	default:
	}
	cp := msg.Copy()
	// watermill-kafka cancels its context when the delivery ends: the
	// router's copy keeps its values only, so that a closing member lets the
	// handler commit.
	cp.SetContext(context.WithValue(context.WithoutCancel(msg.Context()), sessionKey{}, session))
	select {
	case out <- cp:
	case <-cut:
		return
	case <-ctx.Done():
		return
	case <-s.closing:
		return
	}
	select {
	case <-cp.Acked():
		select {
		case <-cut: // lost: Restart ran before the ack
		default:
			msg.Ack()
		}
	case <-cp.Nacked():
		select {
		case <-cut:
		default:
			msg.Nack()
		}
	case <-cut:
	case <-ctx.Done():
	case <-s.closing:
	}
}

// Close ends every subscription (their members leave the groups, marked
// offsets are committed) and waits for them.
func (s *KafkaSubscriber) Close() error {
	s.once.Do(func() { close(s.closing) })
	s.wg.Wait()
	return nil
}
