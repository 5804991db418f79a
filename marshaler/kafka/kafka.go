// Package kafka is the Kafka adapter of the envelope for watermill-kafka v3:
// [Marshaler] implements its MarshalerUnmarshaler on sarama's message types
// and decodes with [marshaler.Decoder], so it never fails on foreign or
// malformed records.
//
// Its tests here use sarama's message types; the module kfaketest runs it
// with watermill-kafka v3 on kfake, franz-go's in-process Kafka (consumer
// groups, rebalances, offset commits).
//
// Why never fail: watermill-kafka v3 returns the Unmarshal error from its
// consumer-group handler, which ends the session; after the rebalance the
// partition is consumed again from the last committed offset, the same record
// fails again, and the partition never moves on. Here such a record becomes
// a message flagged [marshaler.MetadataMalformed], which the middleware
// dead-letters once; its offset is then committed like any other.
//
// Deduplication notes for Kafka:
//
//   - Offsets are not event ids. An offset names a position in one partition
//     of one topic; a republished event (outbox relay, producer retry without
//     idempotence, replay to another topic) gets a new offset, and the same
//     offset in another partition is another record. The middleware claims
//     the event id in the envelope, never (topic, partition, offset).
//   - Redelivery is by offset: after a crash or a rebalance a consumer
//     resumes at the last committed offset, so every record after it (a whole
//     batch, already processed ones included) comes again. Kafka has no
//     per-record redelivered flag nor delivery count:
//     [marshaler.MetadataRedelivered] and [marshaler.MetadataDeliveryCount]
//     are absent on this transport.
//   - The idempotent producer (enable.idempotence) removes duplicates of one
//     producer session's retries within a partition only; it does not cover
//     a relay that republishes after a restart.
//   - Ordering holds per partition: use a partition key (Config.PartitionKey)
//     per entity when consumers depend on order (versioned state copies do
//     not: they compare versions).
package kafka

import (
	"fmt"
	"strconv"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Marshaler is the watermill-kafka v3 [wmkafka.MarshalerUnmarshaler] that puts
// messages in the JSON envelope. The zero value is ready to use; set it as the
// Marshaler of the PublisherConfig and the Unmarshaler of the
// SubscriberConfig.
type Marshaler struct {
	// Decoder decodes received records; its MaxSize (0: the default) is also
	// the largest envelope Marshal publishes. Kafka's own limit
	// (message.max.bytes, 1 MB by default) applies as well.
	Decoder marshaler.Decoder
	// PartitionKey, when set, gives the record key of each published message
	// (records with the same key go to the same partition, in order). Nil
	// means no key (the producer's partitioner spreads records). An error
	// fails the publish.
	PartitionKey func(topic string, msg *message.Message) (string, error)
}

var _ wmkafka.MarshalerUnmarshaler = Marshaler{}

// Marshal turns msg into a producer message for topic: Value is the body of
// [marshaler.EncodeMessage], its headers are record headers, and the
// _watermill_message_uuid header (watermill-kafka's UUID header) holds the
// canonical event id (for a malformed dead-letter copy: msg.UUID). It returns
// the errors of [marshaler.EncodeMessage] and of PartitionKey.
func (m Marshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	body, meta, err := marshaler.EncodeMessage(msg, m.Decoder.MaxSize)
	if err != nil {
		return nil, err
	}
	id := msg.UUID
	if _, malformed := marshaler.Malformed(msg); !malformed {
		canonical, _ := marshaler.ParseEventID(msg.UUID) // EncodeMessage checked it
		id = canonical.String()
	}
	headers := make([]sarama.RecordHeader, 0, len(meta)+1)
	headers = append(headers, sarama.RecordHeader{Key: []byte(wmkafka.UUIDHeaderKey), Value: []byte(id)})
	for k, v := range meta {
		if k != wmkafka.UUIDHeaderKey {
			headers = append(headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
		}
	}
	pm := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(body), Headers: headers}
	if m.PartitionKey != nil {
		key, err := m.PartitionKey(topic, msg)
		if err != nil {
			return nil, fmt.Errorf("kafka: partition key: %w", err)
		}
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, nil
}

// Unmarshal turns a consumed record into a message. It never returns an
// error.
//
// The value is decoded by [marshaler.Decoder.DecodeDelivery] with the record
// headers as headers (a repeated key keeps its last value; a nil key is
// skipped). The UUID of a malformed message is the _watermill_message_uuid
// header, else "<topic>/<partition>/<offset>" (which names the record, not an
// event).
func (m Marshaler) Unmarshal(rec *sarama.ConsumerMessage) (msg *message.Message, _ error) {
	if rec == nil {
		return marshaler.NewMalformed(nil, "", "kafka: nil record"), nil
	}
	defer func() {
		if r := recover(); r != nil {
			msg = marshaler.NewMalformed(rec.Value, recordID(rec), fmt.Sprintf("kafka: internal error decoding the record: %v", r))
		}
	}()
	in := marshaler.Delivery{Body: rec.Value, Headers: make(map[string]string, len(rec.Headers))}
	for _, h := range rec.Headers {
		if h == nil || h.Key == nil {
			continue
		}
		if string(h.Key) == wmkafka.UUIDHeaderKey {
			in.TransportID = string(h.Value)
			continue
		}
		in.Headers[string(h.Key)] = string(h.Value)
	}
	if in.TransportID == "" {
		in.TransportID = recordID(rec)
	}
	msg = m.Decoder.DecodeDelivery(in)
	// The record's partition and offset (wire.Position): the consumer
	// counts the crashes of an attempt unless it just committed the record
	// before it in the partition (so after a start, where the record that
	// killed the last member is), and runs those attempts one at a time.
	msg.Metadata.Set(wire.Position, recordID(rec))
	return msg, nil
}

func recordID(rec *sarama.ConsumerMessage) string {
	return rec.Topic + "/" + strconv.FormatInt(int64(rec.Partition), 10) + "/" + strconv.FormatInt(rec.Offset, 10)
}
