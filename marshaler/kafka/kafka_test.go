package kafka

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

const testID = "0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d"

func event(t *testing.T) *message.Message {
	t.Helper()
	msg, err := marshaler.NewMessageWithID(uuid.MustParse(testID), "order.placed",
		time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC), json.RawMessage(`{"order_id":42}`))
	require.NoError(t, err)
	msg.Metadata.Set("correlation_id", "c-1")
	return msg
}

// consumed turns a producer message into the record a consumer reads.
func consumed(t *testing.T, pm *sarama.ProducerMessage, offset int64) *sarama.ConsumerMessage {
	t.Helper()
	value, err := pm.Value.Encode()
	require.NoError(t, err)
	rec := &sarama.ConsumerMessage{Topic: pm.Topic, Partition: 3, Offset: offset, Value: value}
	for i := range pm.Headers {
		rec.Headers = append(rec.Headers, &pm.Headers[i])
	}
	if pm.Key != nil {
		rec.Key, err = pm.Key.Encode()
		require.NoError(t, err)
	}
	return rec
}

func TestKafkaRoundTrip(t *testing.T) {
	t.Parallel()
	m := Marshaler{PartitionKey: func(_ string, msg *message.Message) (string, error) { return "order-42", nil }}
	pm, err := m.Marshal("orders", event(t))
	require.NoError(t, err)
	require.Equal(t, "orders", pm.Topic)
	key, _ := pm.Key.Encode()
	require.Equal(t, "order-42", string(key))
	out, err := m.Unmarshal(consumed(t, pm, 17))
	require.NoError(t, err)
	require.Equal(t, testID, out.UUID)
	require.Equal(t, `{"order_id":42}`, string(out.Payload))
	require.Equal(t, "c-1", out.Metadata.Get("correlation_id"))
	require.NotContains(t, out.Metadata, wmkafka.UUIDHeaderKey)
	require.NotContains(t, out.Metadata, marshaler.MetadataRedelivered, "Kafka has no redelivered flag")

	_, err = Marshaler{PartitionKey: func(string, *message.Message) (string, error) { return "", errors.New("boom") }}.Marshal("orders", event(t))
	require.Error(t, err)
}

// TestKafkaOffsetIsNotTheEventID: the same event at two offsets (a
// republish) is the same event id; the offset never leaks into msg.UUID.
func TestKafkaOffsetIsNotTheEventID(t *testing.T) {
	t.Parallel()
	pm, err := Marshaler{}.Marshal("orders", event(t))
	require.NoError(t, err)
	a, _ := Marshaler{}.Unmarshal(consumed(t, pm, 1))
	b, _ := Marshaler{}.Unmarshal(consumed(t, pm, 9000))
	require.Equal(t, a.UUID, b.UUID)

	// A record from a foreign producer with a UUID header but no envelope:
	// flagged, never claimed under that header.
	foreign := &sarama.ConsumerMessage{Topic: "orders", Partition: 0, Offset: 5, Value: []byte(`{"order_id":42}`),
		Headers: []*sarama.RecordHeader{{Key: []byte(wmkafka.UUIDHeaderKey), Value: []byte(testID)}}}
	msg, err := Marshaler{}.Unmarshal(foreign)
	require.NoError(t, err)
	_, bad := marshaler.Malformed(msg)
	require.True(t, bad)
}

func TestKafkaUnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	for name, rec := range map[string]*sarama.ConsumerMessage{
		"nil record":    nil,
		"empty":         {Topic: "t", Partition: 1, Offset: 2},
		"not json":      {Topic: "t", Partition: 1, Offset: 3, Value: []byte("\xffhello")},
		"nil header":    {Topic: "t", Value: []byte("x"), Headers: []*sarama.RecordHeader{nil, {Key: nil, Value: []byte("v")}}},
		"spoofed flag":  {Topic: "t", Value: []byte("x"), Headers: []*sarama.RecordHeader{{Key: []byte(marshaler.MetadataMalformed), Value: []byte("false")}}},
		"tombstone nil": {Topic: "t", Value: nil, Key: []byte("k")},
	} {
		t.Run(name, func(t *testing.T) {
			msg, err := Marshaler{}.Unmarshal(rec)
			require.NoError(t, err)
			_, bad := marshaler.Malformed(msg)
			require.True(t, bad)
			require.NotEmpty(t, msg.UUID)
		})
	}
	msg, _ := Marshaler{}.Unmarshal(&sarama.ConsumerMessage{Topic: "t", Partition: 1, Offset: 3, Value: []byte("\xffhello")})
	require.Equal(t, "t/1/3", msg.UUID, "a malformed record is named by its coordinates")
	require.Equal(t, "\xffhello", string(msg.Payload))

	pm, err := Marshaler{}.Marshal("t.dlq", msg)
	require.NoError(t, err)
	value, _ := pm.Value.Encode()
	require.Equal(t, "\xffhello", string(value), "dead-letter copy verbatim")
}

// TestKafkaCloudEventsBinary: the Kafka binding's ce_* headers, with a
// derived claim key for a producer without UUIDs.
func TestKafkaCloudEventsBinary(t *testing.T) {
	t.Parallel()
	rec := &sarama.ConsumerMessage{Topic: "orders", Partition: 0, Offset: 8, Value: []byte(`{"order_id":42}`),
		Headers: []*sarama.RecordHeader{
			{Key: []byte("ce_specversion"), Value: []byte("1.0")}, {Key: []byte("ce_id"), Value: []byte("42-placed")},
			{Key: []byte("ce_source"), Value: []byte("/shop")}, {Key: []byte("ce_type"), Value: []byte("order.placed")},
			{Key: []byte("ce_time"), Value: []byte("2024-07-01T10:00:00Z")},
		}}
	m := Marshaler{Decoder: marshaler.Decoder{ClaimKey: marshaler.UUIDv5ClaimKey(uuid.MustParse(testID))}}
	a, _ := m.Unmarshal(rec)
	_, bad := marshaler.Malformed(a)
	require.False(t, bad, a.Metadata.Get(marshaler.MetadataMalformedReason))
	rec.Offset = 99 // the same event re-read at another offset
	b, _ := m.Unmarshal(rec)
	require.Equal(t, a.UUID, b.UUID)
}
