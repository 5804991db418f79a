package marshaler

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

const testID = "0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d"

// envelopeJSON builds an envelope body from raw member texts; a nil value
// omits the member.
func envelopeJSON(id, name, at, payload *string, extra ...string) []byte {
	var members []string
	add := func(k string, v *string) {
		if v != nil {
			members = append(members, fmt.Sprintf("%q:%s", k, *v))
		}
	}
	add("event_id", id)
	add("event_name", name)
	add("occurred_at", at)
	add("payload", payload)
	members = append(members, extra...)
	return []byte("{" + strings.Join(members, ",") + "}")
}

func ptr(s string) *string { return &s }

func validBody() []byte {
	return envelopeJSON(ptr(`"`+testID+`"`), ptr(`"order.placed"`), ptr(`"2024-07-01T10:00:00.000Z"`), ptr(`{"order_id":42}`))
}

func TestParseEventIDForms(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D",
		"0190a0C1-7c2E-7b61-9D4e-3f1f5A2b6c7D",
		"{0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d}",
		"{0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D}",
		"0190a0c17c2e7b619d4e3f1f5a2b6c7d",
		"0190A0C17C2E7B619D4E3F1F5A2B6C7D",
		"urn:uuid:0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"URN:UUID:0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D",
	} {
		t.Run(in, func(t *testing.T) {
			t.Parallel()
			id, err := ParseEventID(in)
			require.NoError(t, err)
			require.Equal(t, testID, id.String())

			body := envelopeJSON(ptr(`"`+in+`"`), ptr(`"x"`), ptr(`"2024-07-01T10:00:00Z"`), ptr(`1`))
			env, err := Decode(body, 0)
			require.NoError(t, err)
			require.Equal(t, testID, env.EventID.String())
		})
	}
}

func TestParseEventIDRefusals(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"",
		"not-a-uuid",
		" 0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d ",
		"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7g",
		"0190a0c1x7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"0190a0c17-c2e-7b61-9d4e-3f1f5a2b6c7d",
		"(0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d)",
		"{0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"x0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7dx",
		"urn:uid:0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d",
		"urn:uuid:0190a0c17c2e7b619d4e3f1f5a2b6c7d",
		"{0190a0c17c2e7b619d4e3f1f5a2b6c7d}",
		"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d-",
		"0190a0c17c2e7b619d4e3f1f5a2b6c7",
		"+190a0c17c2e7b619d4e3f1f5a2b6c7d",
	} {
		t.Run(in, func(t *testing.T) {
			t.Parallel()
			_, err := ParseEventID(in)
			require.Error(t, err)
			require.False(t, errors.Is(err, ErrNilEventID))
		})
	}
}

func TestParseEventIDNil(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"00000000-0000-0000-0000-000000000000",
		"00000000000000000000000000000000",
		"{00000000-0000-0000-0000-000000000000}",
		"urn:uuid:00000000-0000-0000-0000-000000000000",
	} {
		_, err := ParseEventID(in)
		require.ErrorIs(t, err, ErrNilEventID, in)
		require.Contains(t, err.Error(), "nil UUID")
	}
}

func TestDecodeRefusals(t *testing.T) {
	t.Parallel()
	id := ptr(`"` + testID + `"`)
	name := ptr(`"order.placed"`)
	at := ptr(`"2024-07-01T10:00:00Z"`)
	payload := ptr(`{}`)

	tests := []struct {
		name   string
		body   []byte
		field  string
		reason string // substring
	}{
		{"empty", []byte{}, "", "empty body"},
		{"nil", nil, "", "empty body"},
		{"whitespace", []byte("  \n"), "", "not valid JSON"},
		{"not JSON", []byte("hello"), "", "not valid JSON"},
		{"truncated", []byte(`{"event_id":`), "", "not valid JSON"},
		{"truncated object", validBody()[:40], "", "not valid JSON"},
		{"array", []byte(`[1,2]`), "", "not a JSON object"},
		{"string", []byte(`"x"`), "", "not a JSON object"},
		{"null", []byte(`null`), "", "not a JSON object"},
		{"trailing object", append(validBody(), []byte(` {}`)...), "", "not valid JSON"},
		{"duplicate event_id", envelopeJSON(id, name, at, payload, `"event_id":"`+testID+`"`), "event_id", "duplicate key"},
		{"duplicate extra", envelopeJSON(id, name, at, payload, `"x":1`, `"x":1`), "x", "duplicate key"},
		{"duplicate by escape", envelopeJSON(id, name, at, payload, `"event\u005fname":"y"`), "event_name", "duplicate key"},
		{"event_id missing", envelopeJSON(nil, name, at, payload), "event_id", "missing"},
		{"event_id number", envelopeJSON(ptr(`12345`), name, at, payload), "event_id", "not a JSON string (got number)"},
		{"event_id null", envelopeJSON(ptr(`null`), name, at, payload), "event_id", "not a JSON string (got null)"},
		{"event_id object", envelopeJSON(ptr(`{}`), name, at, payload), "event_id", "not a JSON string (got object)"},
		{"event_id empty", envelopeJSON(ptr(`""`), name, at, payload), "event_id", "empty"},
		{"event_id not a uuid", envelopeJSON(ptr(`"not-a-uuid"`), name, at, payload), "event_id", "not a UUID"},
		{"event_id bad hex", envelopeJSON(ptr(`"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6cZZ"`), name, at, payload), "event_id", "not a UUID"},
		{"event_id nil", envelopeJSON(ptr(`"00000000-0000-0000-0000-000000000000"`), name, at, payload), "event_id", "nil UUID"},
		{"event_id case", envelopeJSON(nil, name, at, payload, `"Event_ID":"`+testID+`"`), "event_id", "missing"},
		{"event_name missing", envelopeJSON(id, nil, at, payload), "event_name", "missing"},
		{"event_name empty", envelopeJSON(id, ptr(`""`), at, payload), "event_name", "empty"},
		{"event_name number", envelopeJSON(id, ptr(`1`), at, payload), "event_name", "not a JSON string"},
		{"event_name null", envelopeJSON(id, ptr(`null`), at, payload), "event_name", "not a JSON string (got null)"},
		{"occurred_at missing", envelopeJSON(id, name, nil, payload), "occurred_at", "missing"},
		{"occurred_at number", envelopeJSON(id, name, ptr(`1719828000`), payload), "occurred_at", "not a JSON string"},
		{"occurred_at empty", envelopeJSON(id, name, ptr(`""`), payload), "occurred_at", "empty"},
		{"occurred_at date only", envelopeJSON(id, name, ptr(`"2024-07-01"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at no offset", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at space", envelopeJSON(id, name, ptr(`"2024-07-01 10:00:00Z"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at comma", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00,5Z"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at empty fraction", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00.Z"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at one-digit hour", envelopeJSON(id, name, ptr(`"2024-07-01T1:00:00Z"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at short offset", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00+0200"`), payload), "occurred_at", "not an RFC 3339"},
		{"occurred_at offset hour", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00+24:00"`), payload), "occurred_at", "offset out of range"},
		{"occurred_at offset minute", envelopeJSON(id, name, ptr(`"2024-07-01T10:00:00+01:60"`), payload), "occurred_at", "offset out of range"},
		{"occurred_at month", envelopeJSON(id, name, ptr(`"2024-13-01T10:00:00Z"`), payload), "occurred_at", "out of range"},
		{"occurred_at feb 30", envelopeJSON(id, name, ptr(`"2024-02-30T10:00:00Z"`), payload), "occurred_at", "out of range"},
		{"occurred_at hour 24", envelopeJSON(id, name, ptr(`"2024-07-01T24:00:00Z"`), payload), "occurred_at", "out of range"},
		{"occurred_at leap second", envelopeJSON(id, name, ptr(`"2016-12-31T23:59:60Z"`), payload), "occurred_at", "out of range"},
		{"occurred_at unix text", envelopeJSON(id, name, ptr(`"1719828000"`), payload), "occurred_at", "not an RFC 3339"},
		{"payload missing", envelopeJSON(id, name, at, nil), "payload", "missing"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Decode(tt.body, 0)
			require.Error(t, err)
			require.ErrorIs(t, err, ErrMalformed)
			var de *DecodeError
			require.ErrorAs(t, err, &de)
			require.Equal(t, tt.field, de.Field)
			require.Contains(t, de.Reason, tt.reason)
			if tt.field != "" {
				require.True(t, strings.HasPrefix(err.Error(), "envelope: "+tt.field+": "), err.Error())
			}
		})
	}
}

func TestDecodeErrorText(t *testing.T) {
	t.Parallel()
	_, err := Decode(envelopeJSON(ptr(`"not-a-uuid"`), ptr(`"x"`), ptr(`"2024-07-01T10:00:00Z"`), ptr(`1`)), 0)
	require.EqualError(t, err, "envelope: event_id: not a UUID (10 characters)")

	_, err = Decode(envelopeJSON(ptr(`"00000000-0000-0000-0000-000000000000"`), ptr(`"x"`), ptr(`"2024-07-01T10:00:00Z"`), ptr(`1`)), 0)
	require.EqualError(t, err, "envelope: event_id: nil UUID")
	require.ErrorIs(t, err, ErrNilEventID)
	require.ErrorIs(t, err, ErrMalformed)

	_, err = Decode(nil, 0)
	require.EqualError(t, err, "envelope: empty body")
}

func TestDecodeValid(t *testing.T) {
	t.Parallel()
	env, err := Decode(validBody(), 0)
	require.NoError(t, err)
	require.Equal(t, testID, env.EventID.String())
	require.Equal(t, "order.placed", env.EventName)
	require.True(t, env.OccurredAt.Equal(time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)))
	require.Equal(t, `{"order_id":42}`, string(env.Payload))
	require.Nil(t, env.Extra)
}

func TestDecodeOccurredAtPrecision(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in     string
		nanos  int
		offset int // seconds east of UTC
	}{
		{"2024-07-01T10:00:00Z", 0, 0},
		{"2024-07-01T10:00:00.123Z", 123000000, 0},
		{"2024-07-01T10:00:00.123456Z", 123456000, 0},
		{"2024-07-01T10:00:00.123456789Z", 123456789, 0},
		{"2024-07-01T10:00:00.000Z", 0, 0},
		{"2024-07-01T10:00:00.100000000Z", 100000000, 0},
		{"2024-07-01T10:00:00.1234567891234Z", 123456789, 0}, // below a nanosecond: dropped
		{"2024-07-01T12:00:00.5+02:00", 500000000, 2 * 3600},
		{"2024-07-01T04:30:00.123456789-05:30", 123456789, -(5*3600 + 30*60)},
		{"2024-07-01T10:00:00+00:00", 0, 0},
		{"2024-07-01T10:00:00-00:00", 0, 0},
		{"2024-07-01t10:00:00.25z", 250000000, 0},
		{"2024-07-01T23:45:00+14:00", 0, 14 * 3600},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			body := envelopeJSON(ptr(`"`+testID+`"`), ptr(`"x"`), ptr(`"`+tt.in+`"`), ptr(`null`))
			env, err := Decode(body, 0)
			require.NoError(t, err)
			require.Equal(t, tt.nanos, env.OccurredAt.Nanosecond())
			_, off := env.OccurredAt.Zone()
			require.Equal(t, tt.offset, off)

			// The text is written back unchanged.
			out, err := env.Encode()
			require.NoError(t, err)
			require.Contains(t, string(out), `"occurred_at":"`+tt.in+`"`)
			msg := FromEnvelope(env)
			require.Equal(t, tt.in, msg.Metadata.Get(MetadataOccurredAt))
		})
	}
	// The same instant in several spellings.
	a, err := Decode(envelopeJSON(ptr(`"`+testID+`"`), ptr(`"x"`), ptr(`"2024-07-01T12:00:00.123456789+02:00"`), ptr(`1`)), 0)
	require.NoError(t, err)
	b, err := Decode(envelopeJSON(ptr(`"`+testID+`"`), ptr(`"x"`), ptr(`"2024-07-01T10:00:00.123456789Z"`), ptr(`1`)), 0)
	require.NoError(t, err)
	require.True(t, a.OccurredAt.Equal(b.OccurredAt))
}

func TestEncodeOccurredAtChanged(t *testing.T) {
	t.Parallel()
	env, err := Decode(envelopeJSON(ptr(`"`+testID+`"`), ptr(`"x"`), ptr(`"2024-07-01T10:00:00.000Z"`), ptr(`1`)), 0)
	require.NoError(t, err)

	env.OccurredAt = env.OccurredAt.Add(1500 * time.Millisecond)
	out, err := env.Encode()
	require.NoError(t, err)
	require.Contains(t, string(out), `"occurred_at":"2024-07-01T10:00:01.5Z"`)

	// Same instant, other offset: the offset given wins.
	env.OccurredAt = time.Date(2024, 7, 1, 12, 0, 0, 7, time.FixedZone("", 2*3600))
	out, err = env.Encode()
	require.NoError(t, err)
	require.Contains(t, string(out), `"occurred_at":"2024-07-01T12:00:00.000000007+02:00"`)
}

func TestPayloadByteForByte(t *testing.T) {
	t.Parallel()
	payloads := []string{
		`{"b":1,  "a":"2.000"}`,
		`{"b" : 1.0e+2 ,"a":[ 1,2 ,3 ], "z":"\u00e9\/"}`,
		`null`,
		`"just a string"`,
		`12345678901234567890123456789`,
		`-0.000`,
		`[]`,
		`{"a":{"a":{"a":{}}},"a":2}`, // duplicate keys inside the payload are its own business
		"{\n\t\"multi\": \"line\"\n}",
		`"<&>"`,
		`true`,
	}
	for _, p := range payloads {
		t.Run(p, func(t *testing.T) {
			t.Parallel()
			body := []byte(`{ "payload" :  ` + p + ` , "event_id":"` + testID + `","event_name":"x","occurred_at":"2024-07-01T10:00:00Z"}`)
			env, err := Decode(body, 0)
			require.NoError(t, err)
			require.Equal(t, p, string(env.Payload))

			out, err := env.Encode()
			require.NoError(t, err)
			require.Contains(t, string(out), `"payload":`+p)
			again, err := Decode(out, 0)
			require.NoError(t, err)
			require.Equal(t, p, string(again.Payload))
		})
	}
}

func TestExtraFieldsRoundTrip(t *testing.T) {
	t.Parallel()
	body := []byte(`{"tenant":"acme","event_id":"` + testID + `","trace":{"id": 1 ,"sampled":true},` +
		`"event_name":"order.placed","occurred_at":"2024-07-01T10:00:00Z","payload":{},"version":2.50,"Event_ID":null}`)
	env, err := Decode(body, 0)
	require.NoError(t, err)
	require.Equal(t, map[string]json.RawMessage{
		"tenant":   json.RawMessage(`"acme"`),
		"trace":    json.RawMessage(`{"id": 1 ,"sampled":true}`),
		"version":  json.RawMessage(`2.50`),
		"Event_ID": json.RawMessage(`null`),
	}, env.Extra)

	out, err := env.Encode()
	require.NoError(t, err)
	require.Equal(t, `{"event_id":"`+testID+`","event_name":"order.placed","occurred_at":"2024-07-01T10:00:00Z","payload":{},`+
		`"Event_ID":null,"tenant":"acme","trace":{"id": 1 ,"sampled":true},"version":2.50}`, string(out))

	again, err := Decode(out, 0)
	require.NoError(t, err)
	require.Equal(t, env, again)

	// Deterministic: the same envelope always encodes the same way.
	for range 20 {
		o, err := again.Encode()
		require.NoError(t, err)
		require.Equal(t, out, o)
	}
}

func TestDecodeSizeLimit(t *testing.T) {
	t.Parallel()
	body := validBody()

	_, err := Decode(body, len(body))
	require.NoError(t, err)

	_, err = Decode(body, len(body)-1)
	require.ErrorIs(t, err, ErrMalformed)
	var de *DecodeError
	require.ErrorAs(t, err, &de)
	require.Equal(t, "", de.Field)
	require.Contains(t, de.Reason, "over the limit")

	pad := strings.Repeat(" ", DefaultMaxSize-len(body))
	_, err = Decode(append([]byte(pad), body...), 0)
	require.NoError(t, err, "exactly DefaultMaxSize is accepted")
	_, err = Decode(append([]byte(pad+" "), body...), 0)
	require.ErrorIs(t, err, ErrMalformed)
	_, err = Decode(append([]byte(pad+" "), body...), -1)
	require.ErrorIs(t, err, ErrMalformed, "a negative limit means the default")
}

func TestEncodeRefusals(t *testing.T) {
	t.Parallel()
	good := Envelope{
		EventID:    uuid.MustParse(testID),
		EventName:  "x",
		OccurredAt: time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC),
		Payload:    json.RawMessage(`{}`),
	}
	_, err := good.Encode()
	require.NoError(t, err)

	tests := map[string]func(e *Envelope){
		"nil id":          func(e *Envelope) { e.EventID = uuid.Nil },
		"empty name":      func(e *Envelope) { e.EventName = "" },
		"bad utf-8 name":  func(e *Envelope) { e.EventName = "a\xffb" },
		"year 10000":      func(e *Envelope) { e.OccurredAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) },
		"year -1":         func(e *Envelope) { e.OccurredAt = time.Date(-1, 1, 1, 0, 0, 0, 0, time.UTC) },
		"nil payload":     func(e *Envelope) { e.Payload = nil },
		"bad payload":     func(e *Envelope) { e.Payload = json.RawMessage(`{"a":`) },
		"two values":      func(e *Envelope) { e.Payload = json.RawMessage(`1 2`) },
		"reserved extra":  func(e *Envelope) { e.Extra = map[string]json.RawMessage{"payload": json.RawMessage(`1`)} },
		"bad extra value": func(e *Envelope) { e.Extra = map[string]json.RawMessage{"a": json.RawMessage(`nope`)} },
	}
	for name, mutate := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := good
			mutate(&e)
			_, err := e.Encode()
			require.Error(t, err)
		})
	}
	e := good
	e.EventID = uuid.Nil
	_, err = e.Encode()
	require.ErrorIs(t, err, ErrNilEventID)
}

func TestEncodeOddOffsetBecomesUTC(t *testing.T) {
	t.Parallel()
	e := Envelope{
		EventID:    uuid.MustParse(testID),
		EventName:  "x",
		OccurredAt: time.Date(2024, 7, 1, 10, 0, 30, 0, time.FixedZone("LMT", 30)),
		Payload:    json.RawMessage(`1`),
	}
	out, err := e.Encode()
	require.NoError(t, err)
	got, err := Decode(out, 0)
	require.NoError(t, err)
	require.True(t, got.OccurredAt.Equal(e.OccurredAt))
	require.Contains(t, string(out), `"2024-07-01T10:00:00Z"`)
}

func TestEncodeNoHTMLEscaping(t *testing.T) {
	t.Parallel()
	e := Envelope{
		EventID:    uuid.MustParse(testID),
		EventName:  "a<b>&c",
		OccurredAt: time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC),
		Payload:    json.RawMessage(`1`),
	}
	out, err := e.Encode()
	require.NoError(t, err)
	require.Contains(t, string(out), `"event_name":"a<b>&c"`)
}
