package marshaler

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// A string field holding bytes that are not UTF-8, or a lone UTF-16 surrogate
// escape, is refused with the field named: encoding/json would hand the
// handler U+FFFD instead of what the producer sent.
func TestDecodeRefusesInvalidText(t *testing.T) {
	t.Parallel()
	id := ptr(`"` + testID + `"`)
	name := ptr(`"order.placed"`)
	at := ptr(`"2024-07-01T10:00:00Z"`)
	payload := ptr(`{}`)
	tests := []struct {
		name   string
		body   []byte
		field  string
		reason string
	}{
		{"event_name invalid UTF-8", envelopeJSON(id, ptr("\"note.\xff(added\""), at, payload), "event_name", "not valid UTF-8"},
		{"event_name truncated sequence", envelopeJSON(id, ptr("\"caf\xc3\""), at, payload), "event_name", "not valid UTF-8"},
		{"event_name lone high surrogate", envelopeJSON(id, ptr(`"note.\ud800"`), at, payload), "event_name", "lone UTF-16 surrogate"},
		{"event_name lone low surrogate", envelopeJSON(id, ptr(`"note.\uDC00x"`), at, payload), "event_name", "lone UTF-16 surrogate"},
		{"event_name high then non-low", envelopeJSON(id, ptr(`"\ud800\u0041"`), at, payload), "event_name", "lone UTF-16 surrogate"},
		{"event_name reversed pair", envelopeJSON(id, ptr(`"\udc00\ud800"`), at, payload), "event_name", "lone UTF-16 surrogate"},
		{"event_id invalid UTF-8", envelopeJSON(ptr("\"\xff"+testID[1:]+"\""), name, at, payload), "event_id", "not valid UTF-8"},
		{"event_id surrogate", envelopeJSON(ptr(`"\ud800`+testID[1:]+`"`), name, at, payload), "event_id", "lone UTF-16 surrogate"},
		{"occurred_at invalid UTF-8", envelopeJSON(id, name, ptr("\"2024-07-01T10:00:00Z\xfe\""), payload), "occurred_at", "not valid UTF-8"},
		{"extra string invalid UTF-8", envelopeJSON(id, name, at, payload, "\"tenant\":\"acme\xff\""), "tenant", "not valid UTF-8"},
		{"extra string surrogate", envelopeJSON(id, name, at, payload, `"tenant":"\udfff"`), "tenant", "lone UTF-16 surrogate"},
		{"extra nested string", envelopeJSON(id, name, at, payload, `"trace":{"k":["\ud83d"]}`), "trace", "lone UTF-16 surrogate"},
		{"extra key invalid UTF-8", envelopeJSON(id, name, at, payload, "\"ten\xffant\":1"), "", "top-level key is not valid UTF-8"},
		{"extra key surrogate", envelopeJSON(id, name, at, payload, `"\ud800":1`), "", "top-level key is a lone UTF-16 surrogate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Decode(tt.body, 0)
			require.Error(t, err)
			require.ErrorIs(t, err, ErrMalformed)
			var de *DecodeError
			require.True(t, errors.As(err, &de))
			require.Equal(t, tt.field, de.Field)
			require.Contains(t, de.Reason, tt.reason)
		})
	}
}

// Valid text in every form stays accepted and unaltered: escaped surrogate
// pairs, escaped backslashes before a "u", raw multi-byte UTF-8, and a
// payload that is not checked at all (it is passed on byte for byte).
func TestDecodeKeepsValidText(t *testing.T) {
	t.Parallel()
	body := envelopeJSON(ptr(`"`+testID+`"`), ptr(`"note.\ud83d\ude00 é \\ud800"`), ptr(`"2024-07-01T10:00:00Z"`),
		ptr("\"\xff\""), `"tenant":"\u00e9\u2028"`, `"ünï":["\uD83D\uDE00"]`)
	env, err := Decode(body, 0)
	require.NoError(t, err)
	require.Equal(t, "note.😀 é \\ud800", env.EventName)
	require.Equal(t, "\"\xff\"", string(env.Payload))
	require.Equal(t, `"\u00e9\u2028"`, string(env.Extra["tenant"]))
	require.Equal(t, `["\uD83D\uDE00"]`, string(env.Extra["ünï"]))
}

// Encode refuses an extra value that Decode would refuse.
func TestEncodeRefusesInvalidTextInExtra(t *testing.T) {
	t.Parallel()
	env, err := Decode(validBody(), 0)
	require.NoError(t, err)
	env.Extra = map[string]json.RawMessage{"tenant": json.RawMessage("\"a\xffb\"")}
	_, err = env.Encode()
	require.ErrorContains(t, err, "not valid UTF-8")
	env.Extra = map[string]json.RawMessage{"tenant": json.RawMessage(`"\ud800"`)}
	_, err = env.Encode()
	require.ErrorContains(t, err, "surrogate")
}
