package redisstream

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack"

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

// asRead turns marshalled fields into what go-redis returns from XREADGROUP:
// every value a string.
func asRead(fields map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(fields))
	for k, v := range fields {
		switch v := v.(type) {
		case []byte:
			out[k] = string(v)
		default:
			out[k] = v
		}
	}
	return out
}

func TestRedisStreamRoundTrip(t *testing.T) {
	t.Parallel()
	fields, err := Marshaler{}.Marshal("orders", event(t))
	require.NoError(t, err)
	require.Equal(t, testID, fields[fieldUUID])
	out, err := Marshaler{}.Unmarshal(asRead(fields))
	require.NoError(t, err)
	require.Equal(t, testID, out.UUID)
	require.Equal(t, `{"order_id":42}`, string(out.Payload))
	require.Equal(t, "order.placed", marshaler.EventName(out))
	require.Equal(t, "c-1", out.Metadata.Get("correlation_id"))
	_, bad := marshaler.Malformed(out)
	require.False(t, bad)
}

// TestRedisStreamCompatibleWithDefault: an entry written by
// watermill-redisstream's default marshaller with an envelope payload decodes,
// and ours decodes with the default one.
func TestRedisStreamCompatibleWithDefault(t *testing.T) {
	t.Parallel()
	body, _, err := marshaler.EncodeMessage(event(t), 0)
	require.NoError(t, err)
	theirs := message.NewMessage(testID, body)
	theirs.Metadata.Set("k", "v")
	fields, err := redisstream.DefaultMarshallerUnmarshaller{}.Marshal("orders", theirs)
	require.NoError(t, err)
	out, err := Marshaler{}.Unmarshal(asRead(fields))
	require.NoError(t, err)
	require.Equal(t, testID, out.UUID)
	require.Equal(t, "v", out.Metadata.Get("k"))

	ours, err := Marshaler{}.Marshal("orders", event(t))
	require.NoError(t, err)
	back, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(asRead(ours))
	require.NoError(t, err)
	require.Equal(t, testID, back.UUID)
	require.Equal(t, "c-1", back.Metadata.Get("correlation_id"))
}

// TestRedisStreamUnmarshalNeverFails: watermill-redisstream's default
// unmarshaller fails on an entry without a UUID, which stops the whole
// subscription; ours flags it.
func TestRedisStreamUnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	_, err := redisstream.DefaultMarshallerUnmarshaller{}.Unmarshal(map[string]interface{}{"foo": "bar"})
	require.Error(t, err, "upstream refuses it (and its subscriber stops)")

	for name, values := range map[string]map[string]interface{}{
		"foreign fields":   {"foo": "bar"},
		"no fields":        {},
		"nil map":          nil,
		"not an envelope":  {fieldUUID: "legacy-1", FieldPayload: "hello"},
		"bad metadata":     {fieldUUID: "legacy-2", FieldPayload: "{}", FieldMetadata: "\xc1"},
		"odd value types":  {FieldPayload: 42, FieldMetadata: 7},
		"spoofed metadata": {FieldPayload: "x", FieldMetadata: mustMsgpack(t, map[string]string{marshaler.MetadataMalformed: "false"})},
	} {
		t.Run(name, func(t *testing.T) {
			msg, err := Marshaler{}.Unmarshal(values)
			require.NoError(t, err)
			reason, bad := marshaler.Malformed(msg)
			require.True(t, bad)
			require.NotEmpty(t, reason)
			require.NotEmpty(t, msg.UUID)
		})
	}
	msg, _ := Marshaler{}.Unmarshal(map[string]interface{}{"foo": "bar"})
	require.JSONEq(t, `{"foo":"bar"}`, string(msg.Payload), "the dead-letter copy shows the entry")
	msg, _ = Marshaler{}.Unmarshal(map[string]interface{}{fieldUUID: "legacy-1", FieldPayload: "hello"})
	require.Equal(t, "legacy-1", msg.UUID)
	require.Equal(t, "hello", string(msg.Payload))
	require.NotContains(t, msg.Metadata, marshaler.MetadataRedelivered, "not known on this transport")
}

func TestRedisStreamMarshalMalformedVerbatim(t *testing.T) {
	t.Parallel()
	bad, _ := Marshaler{}.Unmarshal(map[string]interface{}{fieldUUID: "legacy-1", FieldPayload: "\xffhello"})
	fields, err := Marshaler{}.Marshal("orders.dlq", bad)
	require.NoError(t, err)
	require.Equal(t, "legacy-1", fields[fieldUUID])
	require.Equal(t, "\xffhello", string(fields[FieldPayload].([]byte)))
	again, _ := Marshaler{}.Unmarshal(asRead(fields))
	_, flagged := marshaler.Malformed(again)
	require.True(t, flagged)
	require.Equal(t, "\xffhello", string(again.Payload))

	noID := event(t)
	noID.UUID = "nope"
	_, err = Marshaler{}.Marshal("orders", noID)
	require.Error(t, err)
}

func mustMsgpack(t *testing.T, v map[string]string) string {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return string(b)
}
