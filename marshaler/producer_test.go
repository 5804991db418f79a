package marshaler

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

func TestNewMessage(t *testing.T) {
	t.Parallel()
	before := time.Now()
	msg, err := NewMessage("order.placed", map[string]any{"order_id": 42})
	require.NoError(t, err)
	after := time.Now()

	id, err := uuid.Parse(msg.UUID)
	require.NoError(t, err)
	require.Equal(t, id.String(), msg.UUID, "canonical")
	require.Equal(t, uuid.Version(7), id.Version())
	require.Equal(t, `{"order_id":42}`, string(msg.Payload))
	require.Equal(t, "order.placed", EventName(msg))

	at, err := OccurredAt(msg)
	require.NoError(t, err)
	require.False(t, at.Before(before.Truncate(time.Microsecond)) || at.After(after))
	require.Equal(t, time.UTC, at.Location())
	_, err = time.Parse(time.RFC3339Nano, msg.Metadata.Get(MetadataOccurredAt))
	require.NoError(t, err)

	// UUIDv7 ids of successive messages are ordered.
	next, err := NewMessage("order.placed", nil)
	require.NoError(t, err)
	require.Less(t, msg.UUID, next.UUID)
	require.Equal(t, "null", string(next.Payload))
}

func TestNewMessagePayloadForms(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   any
		want string
	}{
		{json.RawMessage(`{"b":1,  "a":"2.000"}`), `{"b":1,  "a":"2.000"}`},
		{[]byte(" [1, 2]\n"), `[1, 2]`},
		{message.Payload(`"x"`), `"x"`},
		{"a string", `"a string"`},
		{nil, `null`},
		{42, `42`},
		{struct {
			A int `json:"a"`
		}{A: 1}, `{"a":1}`},
	}
	for _, tt := range tests {
		msg, err := NewMessage("x", tt.in)
		require.NoError(t, err)
		require.Equal(t, tt.want, string(msg.Payload))
	}

	raw := []byte(`{"a":1}`)
	msg, err := NewMessage("x", raw)
	require.NoError(t, err)
	raw[2] = 'X'
	require.Equal(t, `{"a":1}`, string(msg.Payload), "payload is copied")

	for _, bad := range []any{
		[]byte(nil), []byte(""), []byte("hello"), json.RawMessage(`{"a":`), json.RawMessage(`1 2`),
		math.NaN(), make(chan int),
	} {
		_, err := NewMessage("x", bad)
		require.Error(t, err, "%T %v", bad, bad)
	}
	_, err = NewMessage("", 1)
	require.Error(t, err)
}

func TestNewMessageWithID(t *testing.T) {
	t.Parallel()
	id := uuid.MustParse(testID)
	at := time.Date(2024, 7, 1, 12, 0, 0, 500, time.FixedZone("CEST", 2*3600))
	msg, err := NewMessageWithID(id, "order.placed", at, json.RawMessage(`1`))
	require.NoError(t, err)
	require.Equal(t, testID, msg.UUID)
	require.Equal(t, "2024-07-01T12:00:00.0000005+02:00", msg.Metadata.Get(MetadataOccurredAt))

	_, err = NewMessageWithID(uuid.Nil, "x", at, 1)
	require.ErrorIs(t, err, ErrNilEventID)
	_, err = NewMessageWithID(id, "", at, 1)
	require.Error(t, err)
	_, err = NewMessageWithID(id, "x", time.Time{}, 1)
	require.Error(t, err)
	_, err = NewMessageWithID(id, "x", time.Date(12000, 1, 1, 0, 0, 0, 0, time.UTC), 1)
	require.Error(t, err)
}

func TestToFromEnvelope(t *testing.T) {
	t.Parallel()
	env, err := Decode([]byte(`{"event_id":"`+testID+`","event_name":"a.b","occurred_at":"2024-07-01T10:00:00.000+00:00",`+
		`"payload":{"x": 1},"tenant":"acme","n":[1, 2]}`), 0)
	require.NoError(t, err)

	msg := FromEnvelope(env)
	require.Equal(t, testID, msg.UUID)
	require.Equal(t, `{"x": 1}`, string(msg.Payload))
	require.Equal(t, message.Metadata{
		MetadataEventName:              "a.b",
		MetadataOccurredAt:             "2024-07-01T10:00:00.000+00:00",
		MetadataExtraPrefix + "tenant": `"acme"`,
		MetadataExtraPrefix + "n":      `[1, 2]`,
	}, msg.Metadata)

	back, err := ToEnvelope(msg)
	require.NoError(t, err)
	require.Equal(t, env, back)

	msg.Payload[2] = 'y'
	require.Equal(t, `{"x": 1}`, string(env.Payload), "FromEnvelope copies the payload")

	// Any UUID text form on msg.UUID is canonicalised.
	msg.UUID = "{" + testID + "}"
	back, err = ToEnvelope(msg)
	require.NoError(t, err)
	require.Equal(t, testID, back.EventID.String())

	// Unrelated metadata is not part of the envelope.
	msg.Metadata.Set("correlation_id", "c")
	back, err = ToEnvelope(msg)
	require.NoError(t, err)
	require.Len(t, back.Extra, 2)

	_, err = ToEnvelope(nil)
	require.Error(t, err)
}

func TestFromEnvelopeHandBuilt(t *testing.T) {
	t.Parallel()
	e := Envelope{
		EventID:    uuid.MustParse(testID),
		EventName:  "x",
		OccurredAt: time.Date(2024, 7, 1, 10, 0, 0, 100, time.UTC),
		Payload:    json.RawMessage(`[]`),
	}
	msg := FromEnvelope(e)
	require.Equal(t, "2024-07-01T10:00:00.0000001Z", msg.Metadata.Get(MetadataOccurredAt))
	back, err := ToEnvelope(msg)
	require.NoError(t, err)
	a, err := e.Encode()
	require.NoError(t, err)
	b, err := back.Encode()
	require.NoError(t, err)
	require.Equal(t, string(a), string(b))
}
