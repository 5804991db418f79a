package jetstream

import (
	"encoding/json"
	"testing"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

const testID = "0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d"

func newMsg(t *testing.T) *marshaler.Envelope {
	t.Helper()
	return &marshaler.Envelope{
		EventID:    uuid.MustParse(testID),
		EventName:  "order.placed",
		OccurredAt: time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC),
		Payload:    json.RawMessage(`{"order_id":42}`),
	}
}

// ackReply is the reply subject of a JetStream delivery (nats.go reads the
// metadata only from a message bound to a subscription, hence Sub in the
// tests): $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.
func ackReply(delivered string) string {
	return "$JS.ACK.orders.worker." + delivered + ".10.7.1700000000000000000.0"
}

func TestJetStreamRoundTrip(t *testing.T) {
	t.Parallel()
	in := marshaler.FromEnvelope(*newMsg(t))
	in.Metadata.Set("correlation_id", "c-1")
	nm, err := Marshaler{}.Marshal("orders.placed", in)
	require.NoError(t, err)
	require.Equal(t, "orders.placed", nm.Subject)
	require.Equal(t, testID, nm.Header.Get(wmnats.WatermillUUIDHdr))
	require.Equal(t, testID+":orders.placed", nm.Header.Get(nats.MsgIdHdr))
	require.Equal(t, "c-1", nm.Header.Get("correlation_id"))

	nm.Reply, nm.Sub = ackReply("1"), &nats.Subscription{}
	out, err := Marshaler{}.Unmarshal(nm)
	require.NoError(t, err)
	require.Equal(t, testID, out.UUID)
	require.Equal(t, `{"order_id":42}`, string(out.Payload))
	require.Equal(t, "order.placed", marshaler.EventName(out))
	require.Equal(t, "c-1", out.Metadata.Get("correlation_id"))
	require.NotContains(t, out.Metadata, nats.MsgIdHdr)
	require.NotContains(t, out.Metadata, wmnats.WatermillUUIDHdr)
	require.False(t, marshaler.Redelivered(out))
	n, ok := marshaler.DeliveryCount(out)
	require.True(t, ok)
	require.Equal(t, int64(0), n)
}

// TestJetStreamUnmarshalNeverFails: watermill-nats leaves a message whose
// Unmarshal failed unacked (redelivered every AckWait forever); ours flags it.
func TestJetStreamUnmarshalNeverFails(t *testing.T) {
	t.Parallel()
	for name, nm := range map[string]*nats.Msg{
		"not json":            {Data: []byte("hello"), Header: nats.Header{nats.MsgIdHdr: {"m-1"}}},
		"empty":               {},
		"foreign watermill":   {Data: []byte(`{"a":1}`), Header: nats.Header{wmnats.WatermillUUIDHdr: {"wm-1"}}},
		"multi-value header":  {Data: []byte("x"), Header: nats.Header{"k": {"a", "b"}}},
		"spoofed flag":        {Data: []byte("x"), Header: nats.Header{marshaler.MetadataMalformed: {"false"}, marshaler.MetadataDeliveryCount: {"99"}}},
		"non-js reply":        {Data: []byte("x"), Reply: "_INBOX.abc"},
		"redelivered 3 times": {Data: []byte("x"), Reply: ackReply("4"), Sub: &nats.Subscription{}},
	} {
		t.Run(name, func(t *testing.T) {
			msg, err := Marshaler{}.Unmarshal(nm)
			require.NoError(t, err)
			reason, bad := marshaler.Malformed(msg)
			require.True(t, bad)
			require.NotEmpty(t, reason)
			require.NotEmpty(t, msg.UUID)
			require.Equal(t, string(nm.Data), string(msg.Payload))
		})
	}
	msg, _ := Marshaler{}.Unmarshal(&nats.Msg{Data: []byte("hello"), Header: nats.Header{nats.MsgIdHdr: {"m-1"}}})
	require.Equal(t, "m-1", msg.UUID)
	msg, _ = Marshaler{}.Unmarshal(&nats.Msg{Data: []byte("x"), Header: nats.Header{"k": {"a", "b"}}})
	require.Equal(t, "a, b", msg.Metadata.Get("k"))
	msg, _ = Marshaler{}.Unmarshal(&nats.Msg{Data: []byte("x"), Header: nats.Header{marshaler.MetadataDeliveryCount: {"99"}}})
	require.NotContains(t, msg.Metadata, marshaler.MetadataDeliveryCount, "a header must not fake the delivery count")
	msg, _ = Marshaler{}.Unmarshal(&nats.Msg{Data: []byte("x"), Reply: ackReply("4"), Sub: &nats.Subscription{}})
	require.True(t, marshaler.Redelivered(msg))
	n, _ := marshaler.DeliveryCount(msg)
	require.Equal(t, int64(3), n)
	msg, _ = Marshaler{}.Unmarshal(nil)
	_, bad := marshaler.Malformed(msg)
	require.True(t, bad)
	msg, _ = Unmarshaler{}.Unmarshal(nil)
	_, bad = marshaler.Malformed(msg)
	require.True(t, bad)
}

func TestJetStreamMarshalMalformedVerbatim(t *testing.T) {
	t.Parallel()
	bad, _ := Marshaler{}.Unmarshal(&nats.Msg{Data: []byte("\xffnot json"), Header: nats.Header{nats.MsgIdHdr: {"m-1"}, "k": {"v"}}})
	nm, err := Marshaler{}.Marshal("orders.dlq", bad)
	require.NoError(t, err)
	require.Equal(t, "\xffnot json", string(nm.Data))
	require.Empty(t, nm.Header.Get(nats.MsgIdHdr), "a dead-letter copy must not be deduplicated by the broker")
	require.Equal(t, "true", nm.Header.Get(marshaler.MetadataMalformed))
	require.Equal(t, "v", nm.Header.Get("k"))
}

func TestJetStreamMarshalRefusesNoEventID(t *testing.T) {
	t.Parallel()
	in := marshaler.FromEnvelope(*newMsg(t))
	in.UUID = "not-a-uuid"
	_, err := Marshaler{}.Marshal("orders", in)
	require.Error(t, err)
}

func TestJetStreamCloudEventsBinary(t *testing.T) {
	t.Parallel()
	nm := &nats.Msg{Data: []byte(`{"order_id":42}`), Header: nats.Header{
		"ce-specversion": {"1.0"}, "ce-id": {testID}, "ce-source": {"/shop"},
		"ce-type": {"order.placed"}, "ce-time": {"2024-07-01T10:00:00Z"},
	}}
	msg, err := Marshaler{}.Unmarshal(nm)
	require.NoError(t, err)
	_, bad := marshaler.Malformed(msg)
	require.False(t, bad, msg.Metadata.Get(marshaler.MetadataMalformedReason))
	require.Equal(t, testID, msg.UUID)
	require.Equal(t, "order.placed", marshaler.EventName(msg))
}
