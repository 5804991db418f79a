package marshaler

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// NewMessage returns a message for a new event: msg.UUID is a fresh UUIDv7
// (RFC 9562 section 5.7: time-ordered, so the processed-event index stays
// append-only), [MetadataEventName] is eventName and [MetadataOccurredAt] is
// the current time in UTC as RFC 3339 with nanoseconds.
//
// payload becomes msg.Payload: a []byte, [json.RawMessage] or
// [message.Payload] is taken as already-encoded JSON and must be one valid
// JSON value (surrounding JSON whitespace is trimmed, since it would not
// survive the envelope anyway); anything else, untyped nil included (→ null),
// is encoded with [json.Marshal]. A Go string is encoded as a JSON string:
// pass json.RawMessage for text that already is JSON.
//
// It returns an error for an empty eventName, a payload that is not valid
// JSON or cannot be marshalled, or when no UUID can be generated.
func NewMessage(eventName string, payload any) (*message.Message, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("marshaler: new event id: %w", err)
	}
	return NewMessageWithID(id, eventName, time.Now().UTC(), payload)
}

// NewMessageWithID is [NewMessage] for an event that already has an id and a
// time, for example when replaying events or relaying them from another
// store. Republishing with the same eventID is what makes consumers skip what
// they already processed.
//
// occurredAt keeps its offset and nanoseconds (an offset that is not a whole
// number of minutes is converted to UTC). It returns an error matching
// [ErrNilEventID] for the nil UUID, and an error for a zero occurredAt or one
// outside the years 0000-9999 (RFC 3339), besides those of [NewMessage].
func NewMessageWithID(eventID uuid.UUID, eventName string, occurredAt time.Time, payload any) (*message.Message, error) {
	if eventID == uuid.Nil {
		return nil, fmt.Errorf("marshaler: event id: %w", ErrNilEventID)
	}
	if eventName == "" {
		return nil, errors.New("marshaler: event name: empty")
	}
	if occurredAt.IsZero() {
		return nil, errors.New("marshaler: occurred at: zero time")
	}
	at, err := formatRFC3339(occurredAt)
	if err != nil {
		return nil, fmt.Errorf("marshaler: occurred at: %w", err)
	}
	body, err := payloadJSON(payload)
	if err != nil {
		return nil, err
	}
	msg := message.NewMessage(eventID.String(), body)
	msg.Metadata.Set(MetadataEventName, eventName)
	msg.Metadata.Set(MetadataOccurredAt, at)
	return msg, nil
}

func payloadJSON(payload any) ([]byte, error) {
	var b []byte
	switch p := payload.(type) {
	case json.RawMessage:
		b = p
	case message.Payload:
		b = p
	case []byte:
		b = p
	default:
		out, err := json.Marshal(payload)
		if err != nil {
			return nil, fmt.Errorf("marshaler: payload: %w", err)
		}
		return out, nil
	}
	b = bytes.Trim(b, " \t\r\n")
	if !json.Valid(b) {
		return nil, errors.New("marshaler: payload: not one valid JSON value")
	}
	return append([]byte(nil), b...), nil
}

// ToEnvelope builds the envelope of a message: EventID from msg.UUID (any form
// [ParseEventID] accepts, canonicalised), EventName from [MetadataEventName],
// OccurredAt from [MetadataOccurredAt] (its text is kept and written back
// unchanged by [Envelope.Encode]), Payload = msg.Payload (not copied) and Extra
// from the [MetadataExtraPrefix] keys. Other metadata is not part of the
// envelope.
//
// It returns an error when msg is nil or flagged malformed (it has no
// envelope), or when any of these is missing or invalid: the producer side
// must never publish a message without a valid event id.
func ToEnvelope(msg *message.Message) (Envelope, error) {
	if msg == nil {
		return Envelope{}, errors.New("marshaler: nil message")
	}
	if _, ok := Malformed(msg); ok {
		return Envelope{}, errors.New("marshaler: message is flagged malformed and has no envelope")
	}
	id, err := ParseEventID(msg.UUID)
	if err != nil {
		return Envelope{}, fmt.Errorf("marshaler: message UUID: %w", err)
	}
	env := Envelope{EventID: id, EventName: msg.Metadata.Get(MetadataEventName)}
	if env.EventName == "" {
		return Envelope{}, fmt.Errorf("marshaler: metadata %s: missing", MetadataEventName)
	}
	if env.OccurredAt, err = OccurredAt(msg); err != nil {
		return Envelope{}, err
	}
	env.occurredAtText = msg.Metadata.Get(MetadataOccurredAt)
	if !json.Valid(msg.Payload) {
		return Envelope{}, errors.New("marshaler: payload: not one valid JSON value")
	}
	env.Payload = json.RawMessage(msg.Payload)
	for k, v := range msg.Metadata {
		name, ok := strings.CutPrefix(k, MetadataExtraPrefix)
		if !ok {
			continue
		}
		switch name {
		case keyEventID, keyEventName, keyOccurredAt, keyPayload:
			return Envelope{}, fmt.Errorf("marshaler: metadata %q: names an envelope field", k)
		}
		if !json.Valid([]byte(v)) {
			return Envelope{}, fmt.Errorf("marshaler: metadata %q: not valid JSON", k)
		}
		if env.Extra == nil {
			env.Extra = make(map[string]json.RawMessage)
		}
		env.Extra[name] = json.RawMessage(v)
	}
	return env, nil
}

// CheckEnvelope reports whether msg can be published as an event envelope:
// nil when [ToEnvelope] accepts it and the envelope encodes, else the error
// of the first that refuses it (no event name, no occurred_at, a msg.UUID
// that is not an event id, a payload that is not JSON, a malformed flag).
// The outbox (outbox.ErrNotEnvelope) and the idempotent middleware
// (middleware.ErrInvalidProduced) refuse what it refuses, before writing.
func CheckEnvelope(msg *message.Message) error {
	env, err := ToEnvelope(msg)
	if err != nil {
		return err
	}
	_, err = env.Encode()
	return err
}

// FromEnvelope returns a message carrying e: msg.UUID is the canonical
// EventID, msg.Payload a copy of Payload, and metadata [MetadataEventName],
// [MetadataOccurredAt] (the decoded text when OccurredAt is unchanged, else
// RFC 3339 with nanoseconds) and one [MetadataExtraPrefix] key per extra
// field. It does not validate e; [ToEnvelope] and [Envelope.Encode] do.
func FromEnvelope(e Envelope) *message.Message {
	msg := message.NewMessage(e.EventID.String(), append([]byte(nil), e.Payload...))
	msg.Metadata.Set(MetadataEventName, e.EventName)
	at, err := e.occurredAtString()
	if err != nil {
		at = e.OccurredAt.UTC().Format(time.RFC3339Nano)
	}
	msg.Metadata.Set(MetadataOccurredAt, at)
	for k, v := range e.Extra {
		msg.Metadata.Set(MetadataExtraPrefix+k, string(v))
	}
	return msg
}
