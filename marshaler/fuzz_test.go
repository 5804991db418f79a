package marshaler

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

// fuzzSeeds are the interesting bodies: valid ones in every shape, and one of
// each refusal.
var fuzzSeeds = []string{
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"order.placed","occurred_at":"2024-07-01T10:00:00.000Z","payload":{"order_id":42}}`,
	`{"event_id":"{0190A0C1-7C2E-7B61-9D4E-3F1F5A2B6C7D}","event_name":"x","occurred_at":"2024-07-01t10:00:00.123456789+02:00","payload":null,"tenant":"acme"}`,
	`{"event_id":"urn:uuid:0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00.1234567891234z","payload":{"b":1,  "a":"2.000"}}`,
	` { "payload" : [1, 2] , "event_id" : "0190a0c17c2e7b619d4e3f1f5a2b6c7d", "event_name" : "\u00e9\u2028<>", "occurred_at" : "0000-01-01T00:00:00-00:00", "\ud800" : "\udfff" } `,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":"\xff\xfe","\xff":1,"\xfe":2}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1,"event\u005fid":"x"}`,
	`{"event_id":"00000000-0000-0000-0000-000000000000","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":12345,"event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":"","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":"not-a-uuid","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","occurred_at":"2024-07-01T10:00:00Z","payload":1}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-02-30T10:00:00Z","payload":1}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00+24:00","payload":1}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00Z"}`,
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"x","occurred_at":"2024-07-01T10:00:00Z","payload":1} {}`,
	`{"event_id":`,
	`{"specversion":"1.0","id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","source":"/s","type":"x","time":"2024-07-01T10:00:00Z","data":{"a":1}}`,
	`{"specversion":"1.0","id":"not-a-uuid","source":"/s","type":"x","time":"2024-07-01T10:00:00Z"}`,
	`[]`,
	`null`,
	``,
	"\x00",
	"{\"event_id\":\"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d\",\"event_name\":\"note.\xff(added\",\"occurred_at\":\"2024-07-01T10:00:00Z\",\"payload\":1}",
	`{"event_id":"0190a0c1-7c2e-7b61-9d4e-3f1f5a2b6c7d","event_name":"\ud83d\ude00\\ud800","occurred_at":"2024-07-01T10:00:00Z","payload":1,"t":["\udbff\udfff"]}`,
}

// FuzzDecode checks that Decode never panics, that each refusal is a
// *DecodeError matching ErrMalformed, and that whatever decodes re-encodes to
// an envelope that decodes to the same envelope and encodes to the same bytes.
func FuzzDecode(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		env, err := Decode(data, 0)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) || !errors.Is(err, ErrMalformed) {
				t.Fatalf("refusal %v (%T) is not a *DecodeError matching ErrMalformed", err, err)
			}
			return
		}
		// What decodes is valid text: nothing was replaced by U+FFFD.
		if !utf8.ValidString(env.EventName) {
			t.Fatalf("accepted an event_name that is not valid UTF-8: %q", env.EventName)
		}
		for k, v := range env.Extra {
			if !utf8.ValidString(k) || textProblem(v) != "" {
				t.Fatalf("accepted an extra field that is not valid text: %q: %q", k, v)
			}
		}
		out, err := env.Encode()
		if err != nil {
			t.Fatalf("decoded envelope does not encode: %v", err)
		}
		// Escapes may grow when re-encoded (invalid UTF-8 → \ufffd), so no limit here.
		again, err := Decode(out, len(out))
		if err != nil {
			t.Fatalf("encoded envelope does not decode: %v\n%s", err, out)
		}
		if !sameEnvelope(env, again) {
			t.Fatalf("round trip changed the envelope:\n%#v\n%#v", env, again)
		}
		out2, err := again.Encode()
		if err != nil {
			t.Fatalf("second encode: %v", err)
		}
		if !bytes.Equal(out, out2) {
			t.Fatalf("encoding is not stable:\n%s\n%s", out, out2)
		}
	})
}

func sameEnvelope(a, b Envelope) bool {
	if a.EventID != b.EventID || a.EventName != b.EventName || !sameTime(a.OccurredAt, b.OccurredAt) ||
		a.occurredAtText != b.occurredAtText || !bytes.Equal(a.Payload, b.Payload) || len(a.Extra) != len(b.Extra) {
		return false
	}
	for k, v := range a.Extra {
		w, ok := b.Extra[k]
		if !ok || !bytes.Equal(v, w) {
			return false
		}
	}
	return true
}

// FuzzDecodeMessage checks that the adapters' entry point never panics or
// returns nil, flags exactly what Decode refuses, keeps a refused body byte
// for byte, and that EncodeMessage of its result succeeds and decodes back to
// the same message.
func FuzzDecodeMessage(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s), "")
		f.Add([]byte(s), "transport-id")
	}
	f.Fuzz(func(t *testing.T, body []byte, transportID string) {
		msg := DecodeMessage(body, 0, transportID)
		if msg == nil || msg.UUID == "" {
			t.Fatalf("DecodeMessage returned %v", msg)
		}
		_, flagged := Malformed(msg)
		if _, decodeErr := Decode(body, 0); decodeErr == nil && flagged {
			t.Fatalf("flagged a valid envelope")
		} else if decodeErr != nil && !flagged && !strings.Contains(string(body), "specversion") {
			t.Fatalf("not flagged but Decode error %v (and not a CloudEvent)", decodeErr)
		}
		if flagged && (!bytes.Equal(body, msg.Payload) || (transportID != "" && msg.UUID != transportID)) {
			t.Fatalf("raw body or transport id not kept")
		}
		out, _, err := EncodeMessage(msg, 0)
		if err != nil {
			t.Fatalf("EncodeMessage of a decoded message: %v", err)
		}
		back := DecodeMessage(out, len(out)+1, msg.UUID)
		_, flaggedAgain := Malformed(back)
		if flaggedAgain != flagged || back.UUID != msg.UUID || !bytes.Equal(back.Payload, msg.Payload) {
			t.Fatalf("round trip changed the message: %v %q %q / %v %q %q",
				flagged, msg.UUID, msg.Payload, flaggedAgain, back.UUID, back.Payload)
		}
	})
}
