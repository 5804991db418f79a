package marshaler

import (
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

const ceStructured = `{"specversion":"1.0","id":"` + testID + `","source":"/orders","type":"order.placed",` +
	`"time":"2024-07-01T10:00:00.5Z","datacontenttype":"application/json","tenant":"acme","data":{"b":1,  "a":2}}`

func TestCloudEventsStructured(t *testing.T) {
	t.Parallel()
	msg := DecodeMessage([]byte(ceStructured), 0, "t-1")
	_, bad := Malformed(msg)
	require.False(t, bad, msg.Metadata.Get(MetadataMalformedReason))
	require.Equal(t, testID, msg.UUID)
	require.Equal(t, "order.placed", EventName(msg))
	require.Equal(t, "2024-07-01T10:00:00.5Z", msg.Metadata.Get(MetadataOccurredAt))
	require.Equal(t, `{"b":1,  "a":2}`, string(msg.Payload), "data byte for byte")
	require.Equal(t, `"/orders"`, msg.Metadata.Get(MetadataExtraPrefix+"source"))
	require.Equal(t, `"acme"`, msg.Metadata.Get(MetadataExtraPrefix+"tenant"))
	require.Equal(t, `"`+testID+`"`, msg.Metadata.Get(MetadataExtraPrefix+"id"))

	// Republished, it travels as our envelope and decodes to the same message.
	body, _, err := EncodeMessage(msg, 0)
	require.NoError(t, err)
	again := DecodeMessage(body, 0, "")
	require.Equal(t, msg.UUID, again.UUID)
	require.Equal(t, string(msg.Payload), string(again.Payload))
}

func TestCloudEventsForeignIDNeedsClaimKey(t *testing.T) {
	t.Parallel()
	body := []byte(strings.Replace(ceStructured, `"id":"`+testID+`"`, `"id":"order-42-placed"`, 1))
	msg := DecodeMessage(body, 0, "t-1")
	reason, bad := Malformed(msg)
	require.True(t, bad, "a non-UUID id cannot be claimed without a ClaimKey")
	require.Contains(t, reason, "ClaimKey")

	ns := uuid.MustParse("6ba7b811-9dad-11d1-80b4-00c04fd430c8")
	d := Decoder{ClaimKey: UUIDv5ClaimKey(ns)}
	a := d.Decode(body, "t-1")
	b := d.Decode(body, "t-2")
	_, bad = Malformed(a)
	require.False(t, bad, a.Metadata.Get(MetadataMalformedReason))
	require.Equal(t, a.UUID, b.UUID, "the same foreign event gives the same claim key")
	require.Equal(t, uuid.NewSHA1(ns, []byte("/orders\x00order-42-placed")).String(), a.UUID)

	other := d.Decode([]byte(strings.Replace(string(body), `"source":"/orders"`, `"source":"/billing"`, 1)), "")
	require.NotEqual(t, a.UUID, other.UUID, "ids are unique per source only")

	nilKey := Decoder{ClaimKey: func(ForeignID) (uuid.UUID, error) { return uuid.Nil, nil }}.Decode(body, "")
	_, bad = Malformed(nilKey)
	require.True(t, bad)
}

func TestCloudEventsRefusals(t *testing.T) {
	t.Parallel()
	for name, body := range map[string]string{
		"no id":           `{"specversion":"1.0","source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
		"no source":       `{"specversion":"1.0","id":"` + testID + `","type":"x","time":"2024-07-01T10:00:00Z"}`,
		"no type":         `{"specversion":"1.0","id":"` + testID + `","source":"/s","time":"2024-07-01T10:00:00Z"}`,
		"no time":         `{"specversion":"1.0","id":"` + testID + `","source":"/s","type":"x"}`,
		"bad time":        `{"specversion":"1.0","id":"` + testID + `","source":"/s","type":"x","time":"yesterday"}`,
		"spec 0.3":        `{"specversion":"0.3","id":"` + testID + `","source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
		"nil id":          `{"specversion":"1.0","id":"00000000-0000-0000-0000-000000000000","source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
		"both data":       `{"specversion":"1.0","id":"` + testID + `","source":"/s","type":"x","time":"2024-07-01T10:00:00Z","data":1,"data_base64":"AA=="}`,
		"envelope clash":  `{"specversion":"1.0","id":"` + testID + `","source":"/s","type":"x","time":"2024-07-01T10:00:00Z","payload":1}`,
		"id not a string": `{"specversion":"1.0","id":42,"source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
	} {
		t.Run(name, func(t *testing.T) {
			msg := Decoder{ClaimKey: UUIDv5ClaimKey(uuid.New())}.Decode([]byte(body), "")
			reason, bad := Malformed(msg)
			require.True(t, bad)
			require.Contains(t, reason, "envelope:")
			require.Equal(t, body, string(msg.Payload))
		})
	}
	// data_base64 is kept as text with its marker.
	msg := DecodeMessage([]byte(`{"specversion":"1.0","id":"`+testID+`","source":"/s","type":"x","time":"2024-07-01T10:00:00Z","data_base64":"AAE="}`), 0, "")
	_, bad := Malformed(msg)
	require.False(t, bad)
	require.Equal(t, `"AAE="`, string(msg.Payload))
	require.Equal(t, `"AAE="`, msg.Metadata.Get(MetadataExtraPrefix+"data_base64"))
	// A plain JSON object that is neither form keeps the envelope's reason.
	reason, _ := Malformed(DecodeMessage([]byte(`{"order_id":42}`), 0, ""))
	require.Equal(t, "envelope: event_id: missing", reason)
}

func TestCloudEventsBinary(t *testing.T) {
	t.Parallel()
	for _, prefix := range []string{"ce-", "Ce-", "ce_", "cloudEvents:", "cloudEvents_"} {
		h := map[string]string{
			prefix + "specversion": "1.0", prefix + "id": testID, prefix + "source": "/orders",
			prefix + "type": "order.placed", prefix + "time": "2024-07-01T10:00:00Z", "traceparent": "00-abc",
		}
		msg := Decoder{}.DecodeDelivery(Delivery{Body: []byte(`{"order_id":42}`), Headers: h, TransportID: "t"})
		_, bad := Malformed(msg)
		require.False(t, bad, "%s: %s", prefix, msg.Metadata.Get(MetadataMalformedReason))
		require.Equal(t, testID, msg.UUID)
		require.Equal(t, "order.placed", EventName(msg))
		require.Equal(t, `{"order_id":42}`, string(msg.Payload))
		require.Equal(t, "00-abc", msg.Metadata.Get("traceparent"))
	}
	h := map[string]string{"ce-specversion": "1.0", "ce-id": "42", "ce-source": "/o", "ce-type": "x", "ce-time": "2024-07-01T10:00:00Z"}
	_, bad := Malformed(Decoder{}.DecodeDelivery(Delivery{Body: []byte(`{}`), Headers: h}))
	require.True(t, bad, "non-UUID id without ClaimKey")
	ok := Decoder{ClaimKey: UUIDv5ClaimKey(uuid.New())}.DecodeDelivery(Delivery{Body: []byte(`{}`), Headers: h})
	_, bad = Malformed(ok)
	require.False(t, bad)
	_, bad = Malformed(Decoder{ClaimKey: UUIDv5ClaimKey(uuid.New())}.DecodeDelivery(Delivery{Body: []byte(`not json`), Headers: h}))
	require.True(t, bad, "binary data must be JSON")
	delete(h, "ce-time")
	_, bad = Malformed(Decoder{ClaimKey: UUIDv5ClaimKey(uuid.New())}.DecodeDelivery(Delivery{Body: []byte(`{}`), Headers: h}))
	require.True(t, bad)
	// An envelope body wins over headers.
	env := Decoder{}.DecodeDelivery(Delivery{Body: validBody(), Headers: map[string]string{"ce-specversion": "1.0", "ce-id": "zzz"}})
	require.Equal(t, testID, env.UUID)
}
