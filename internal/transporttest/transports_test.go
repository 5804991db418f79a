package transporttest_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/internal/transporttest"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
	redismarshaler "github.com/watermill-idempotency/idempotency/marshaler/redisstream"
)

func TestGoChannel(t *testing.T) {
	t.Parallel()
	transporttest.Run(t, transporttest.Transport{
		Name: "gochannel",
		NewTopic: func(t *testing.T) transporttest.Topic {
			pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			t.Cleanup(func() { _ = pubsub.Close() })
			name := testenv.UniqueName("ct")
			return transporttest.Topic{
				Name:      name,
				Publisher: pubsub,
				// Every subscriber of a GoChannel gets every message (fan-out):
				// competing copies, which the claim serialises.
				NewSubscriber: func(t *testing.T, _ string) message.Subscriber { return noClose{pubsub} },
				PublishRaw: func(t *testing.T, body []byte) {
					// No wire here: what a marshaler would make of a foreign body.
					require.NoError(t, pubsub.Publish(name, marshaler.DecodeMessage(body, 0, "")))
				},
			}
		},
	})
}

// noClose keeps a subscriber's Close from closing the shared GoChannel.
type noClose struct{ *gochannel.GoChannel }

func (noClose) Close() error { return nil }

// TestRabbitMQ runs the contract on RabbitMQ with the shop's topology
// (a topic exchange, a quorum queue per consumer) and the shop's subscriber:
// watermill-amqp v3's own subscriber races on reconnection
// (ThreeDotsLabs/watermill#693), which the connection-cut scenario triggers
// under the race detector. Publishing is watermill-amqp's, with confirms.
func TestRabbitMQ(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testenv.AMQPURL())
	require.NoError(t, err)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err, "RabbitMQ at %s unreachable", testenv.AMQPURL())
	t.Cleanup(func() { _ = conn.Close() })
	urlFor := func(addr string) string {
		v := *u
		v.Host = addr
		return v.String()
	}
	reconnect := &wamqp.ReconnectConfig{BackoffInitialInterval: 50 * time.Millisecond, BackoffMultiplier: 2, BackoffMaxInterval: 500 * time.Millisecond}
	transporttest.Run(t, transporttest.Transport{
		Name:       "rabbitmq",
		BrokerAddr: u.Host,
		NewTopic: func(t *testing.T) transporttest.Topic {
			topo := shop.Topology{Prefix: testenv.UniqueName("ct") + ".", Reconnect: reconnect}
			consumer := shop.Consumer{Name: "contract", Bindings: []string{"#"}}
			// A name of its own per topic (the rig's event topic and its
			// poison topic are two): the chain recognises a delivery from
			// its poison topic by the subscribe topic's name.
			name := topo.Prefix + "contract.happened"
			ch, err := conn.Channel()
			require.NoError(t, err)
			require.NoError(t, topo.Declare(ch, consumer))
			t.Cleanup(func() {
				_ = topo.Delete(ch, consumer)
				_ = ch.Close()
			})
			pub, err := wamqp.NewPublisher(topo.PublisherConfig(testenv.AMQPURL()), watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return transporttest.Topic{
				Name:      name,
				Publisher: pub,
				NewSubscriber: func(t *testing.T, addr string) message.Subscriber {
					sub, err := topo.NewSubscriber(urlFor(addr), consumer, watermill.NopLogger{})
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					return sub
				},
				PublishRaw: func(t *testing.T, body []byte) {
					require.NoError(t, ch.PublishWithContext(context.Background(), topo.ExchangeName(), name, false, false,
						amqp091.Publishing{Body: body, DeliveryMode: amqp091.Persistent}))
				},
				Pending: func(t *testing.T) int {
					c, err := conn.Channel()
					require.NoError(t, err)
					defer c.Close()
					q, err := c.QueueDeclarePassive(topo.Queue(consumer), true, false, false, false, nil)
					require.NoError(t, err)
					return q.Messages // ready ones; unacked ones are the consumer's
				},
			}
		},
	})
}

func TestJetStream(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testenv.NATSURL())
	require.NoError(t, err)
	nc, err := nats.Connect(testenv.NATSURL())
	require.NoError(t, err, "NATS at %s unreachable", testenv.NATSURL())
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	transporttest.Run(t, transporttest.Transport{
		Name:       "jetstream",
		BrokerAddr: u.Host,
		NewTopic: func(t *testing.T) transporttest.Topic {
			name := testenv.UniqueName("ct")
			group := name + "_g"
			_, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name}, Storage: nats.FileStorage})
			require.NoError(t, err, "JetStream at %s", testenv.NATSURL())
			// The durable consumer is created here, not by the library, so a
			// subscriber's Unsubscribe does not delete it (and its pending acks).
			_, err = js.AddConsumer(name, &nats.ConsumerConfig{
				Durable: group, DeliverSubject: nats.NewInbox(), DeliverGroup: group,
				AckPolicy: nats.AckExplicitPolicy, AckWait: time.Second, DeliverPolicy: nats.DeliverAllPolicy,
				FilterSubject: name,
			})
			require.NoError(t, err)
			t.Cleanup(func() { _ = js.DeleteStream(name) })
			jsCfg := wmnats.JetStreamConfig{DurablePrefix: group}
			pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{
				URL: testenv.NATSURL(), Marshaler: jetstream.Marshaler{}, JetStream: jsCfg,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return transporttest.Topic{
				Name:      name,
				Publisher: pub,
				NewSubscriber: func(t *testing.T, addr string) message.Subscriber {
					// The recommended subscriber, on the consumer made above.
					sub, err := jetstream.NewSubscriber(jetstream.SubscriberConfig{
						URL: "nats://" + addr, Stream: name, Durable: group,
						AckWait: time.Second, CloseTimeout: 5 * time.Second,
						NatsOptions: []nats.Option{nats.ReconnectWait(100 * time.Millisecond)},
					}, watermill.NopLogger{})
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					return sub
				},
				PublishRaw: func(t *testing.T, body []byte) {
					_, err := js.Publish(name, body)
					require.NoError(t, err)
				},
				Republish: func(t *testing.T, msg *message.Message) {
					nm, err := jetstream.Marshaler{}.Marshal(name, msg)
					require.NoError(t, err)
					nm.Header.Del(nats.MsgIdHdr) // as a copy past the duplicate window arrives
					ack, err := js.PublishMsg(nm)
					require.NoError(t, err)
					require.False(t, ack.Duplicate)
				},
				Pending: func(t *testing.T) int {
					ci, err := js.ConsumerInfo(name, group)
					require.NoError(t, err)
					return ci.NumAckPending + int(ci.NumPending)
				},
			}
		},
	})
}

func TestRedisStreams(t *testing.T) {
	t.Parallel()
	addr := testenv.RedisAddr()
	admin := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = admin.Close() })
	require.NoError(t, admin.Ping(context.Background()).Err(), "Redis at %s unreachable", addr)
	transporttest.Run(t, transporttest.Transport{
		Name:       "redisstream",
		BrokerAddr: addr,
		NewTopic: func(t *testing.T) transporttest.Topic {
			name := testenv.UniqueName("ct")
			group := name + "_g"
			ctx := context.Background()
			require.NoError(t, admin.XGroupCreateMkStream(ctx, name, group, "0").Err())
			t.Cleanup(func() { _ = admin.Del(context.Background(), name).Err() })
			pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{
				Client: admin, Marshaller: redismarshaler.Marshaler{},
			}, watermill.NopLogger{})
			require.NoError(t, err)
			return transporttest.Topic{
				Name:      name,
				Publisher: pub,
				NewSubscriber: func(t *testing.T, addr string) message.Subscriber {
					client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
					sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
						Client: redismarshaler.CountingClient(client), Unmarshaller: redismarshaler.Marshaler{},
						ConsumerGroup: group, Consumer: testenv.UniqueName("c"),
						BlockTime: 100 * time.Millisecond, ClaimInterval: 100 * time.Millisecond,
						MaxIdleTime: 500 * time.Millisecond, CheckConsumersInterval: time.Hour,
					}, watermill.NopLogger{})
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close(); _ = client.Close() })
					return sub
				},
				PublishRaw: func(t *testing.T, body []byte) {
					require.NoError(t, admin.XAdd(context.Background(), &redis.XAddArgs{
						Stream: name, Values: map[string]interface{}{"foreign": string(body)},
					}).Err())
				},
				Pending: func(t *testing.T) int {
					groups, err := admin.XInfoGroups(context.Background(), name).Result()
					require.NoError(t, err)
					for _, g := range groups {
						if g.Name == group {
							return int(g.Pending + g.Lag)
						}
					}
					t.Fatalf("group %s missing", group)
					return 0
				},
			}
		},
	})
}
