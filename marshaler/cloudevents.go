package marshaler

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
)

// CloudEvents 1.0 (https://github.com/cloudevents/spec, cloudevents/spec.md
// and formats/json-format.md) is accepted as a second envelope form, in both
// of its content modes:
//
//   - structured: the body is a JSON object with specversion, id, source,
//     type and optionally time, data or data_base64 and extensions
//     (application/cloudevents+json);
//   - binary: the attributes travel as headers (ce-id, ce-type, ce-source,
//     ce-specversion, ce-time; the prefixes ce-, ce_, cloudEvents: and
//     cloudEvents_ are all recognised, in any case) and the body is the data.
//
// The mapping: event_id = id when it is a UUID in any form [ParseEventID]
// accepts, else the key [Decoder.ClaimKey] derives (without ClaimKey such an
// event is malformed: its id cannot be claimed); event_name = type;
// occurred_at = time; payload = data. Every other attribute of a structured
// event (id, source, specversion, datacontenttype, extensions, data_base64)
// is kept as an extra field ([MetadataExtraPrefix]), so a republished event
// travels as this package's envelope with its CloudEvents attributes; the
// headers of a binary event are metadata like any other header.
//
// Stricter than CloudEvents: time is required (the replay-horizon check of
// the middleware needs the event's age when the id is not a UUIDv7), and the
// data of a binary event must be one JSON value (the payload is JSON).

// ForeignID is how a producer that is not ours identifies an event, for
// [Decoder.ClaimKey].
type ForeignID struct {
	// ID is the producer's id of the event (the CloudEvents id attribute). A
	// producer must keep it across its own retries: an id made per attempt
	// deduplicates nothing.
	ID string
	// Source names the producer (the CloudEvents source attribute). id is
	// unique only within a source (CloudEvents spec, "id").
	Source string
	// Type is the event type (CloudEvents type), for example
	// "com.example.order.placed".
	Type string
	// Data is the event's data as received (one JSON value, or nil), for keys
	// derived from a natural key in the payload.
	Data json.RawMessage
}

// UUIDv5ClaimKey returns a [Decoder.ClaimKey] that derives the claim key as
// the name-based UUID version 5 (RFC 9562 section 5.5: SHA-1 of namespace and
// name) of source + "\x00" + id. The same source and id always give the same
// key, in every process, so redeliveries and republishes of one event claim
// one row.
//
// Trade-offs, to weigh before using it:
//   - namespace is part of every key: changing it (or the derivation) later
//     makes every event retained in the processed store look new, and a
//     replay applies them again. Pick one namespace per producer, for good.
//   - The key is only as stable as the producer's id: a producer that makes a
//     new id per retry is deduplicated by nothing here; derive the key from a
//     natural key in Data instead (a custom ClaimKey), for example the order
//     id and the event type, which then also merges events the producer
//     meant as distinct (two "status changed" events of one order).
//   - A version 5 UUID carries no time, so the event's age for the replay
//     horizon comes from occurred_at (CloudEvents time), which the producer's
//     clock sets.
//   - SHA-1 collisions between distinct names are not a practical concern
//     for deduplication (no adversary chooses the ids), but two sources that
//     share a namespace and reuse each other's ids collide by construction:
//     keep source in the name, as this function does.
func UUIDv5ClaimKey(namespace uuid.UUID) func(ForeignID) (uuid.UUID, error) {
	return func(f ForeignID) (uuid.UUID, error) {
		if f.ID == "" {
			return uuid.Nil, errors.New("empty id")
		}
		return uuid.NewSHA1(namespace, []byte(f.Source+"\x00"+f.ID)), nil
	}
}

// ceAttributes are the CloudEvents context attributes mapped to envelope
// fields (others are kept as extra fields).
const (
	ceID          = "id"
	ceSource      = "source"
	ceSpecVersion = "specversion"
	ceType        = "type"
	ceTime        = "time"
	ceData        = "data"
	ceDataBase64  = "data_base64"
)

// headerPrefixes are the binary-mode attribute header prefixes of the
// CloudEvents protocol bindings: HTTP and NATS (ce-), Kafka (ce_), AMQP
// (cloudEvents: and the older cloudEvents_).
var headerPrefixes = []string{"ce-", "ce_", "cloudevents:", "cloudevents_"}

// structuredCloudEvent decodes body as a structured CloudEvent. ok is false
// when body is not one (no specversion member): the caller then reports its
// own refusal. body is already valid JSON and within the size limit.
func (d Decoder) structuredCloudEvent(body []byte) (env Envelope, ok bool, err error) {
	if !json.Valid(body) {
		return Envelope{}, false, nil
	}
	fields, derr := splitObject(body)
	if derr != nil {
		return Envelope{}, false, nil
	}
	if _, ok := fields[ceSpecVersion]; !ok {
		return Envelope{}, false, nil
	}
	attr := func(name string, required bool) (string, error) {
		raw, ok := fields[name]
		if !ok {
			if required {
				return "", refuse("cloudevents "+name, "missing")
			}
			return "", nil
		}
		s, derr := jsonString("cloudevents "+name, raw)
		if derr != nil {
			return "", derr
		}
		return s, nil
	}
	for _, k := range []string{keyEventID, keyEventName, keyOccurredAt, keyPayload} {
		if _, clash := fields[k]; clash {
			return Envelope{}, true, refuse(k, "a CloudEvents member names an envelope field")
		}
	}
	spec, err := attr(ceSpecVersion, true)
	if err != nil {
		return Envelope{}, true, err
	}
	if !strings.HasPrefix(spec, "1.") {
		return Envelope{}, true, refuse("cloudevents specversion", "not 1.x")
	}
	var f ForeignID
	if f.ID, err = attr(ceID, true); err != nil {
		return Envelope{}, true, err
	}
	if f.Source, err = attr(ceSource, true); err != nil {
		return Envelope{}, true, err
	}
	if f.Type, err = attr(ceType, true); err != nil {
		return Envelope{}, true, err
	}
	at, err := attr(ceTime, true)
	if err != nil {
		return Envelope{}, true, err
	}
	data, hasData := fields[ceData]
	b64, hasB64 := fields[ceDataBase64]
	switch {
	case hasData && hasB64:
		return Envelope{}, true, refuse("cloudevents data", "both data and data_base64")
	case hasData:
		f.Data = data
	case hasB64:
		if _, derr := jsonString("cloudevents data_base64", b64); derr != nil {
			return Envelope{}, true, derr
		}
		f.Data = b64 // the base64 text, as a JSON string; data_base64 stays an extra field
	default:
		f.Data = json.RawMessage("null")
	}
	env, err = d.cloudEnvelope(f, at)
	if err != nil {
		return Envelope{}, true, err
	}
	for _, k := range []string{ceType, ceTime, ceData} {
		delete(fields, k)
	}
	if len(fields) > 0 {
		env.Extra = fields
	}
	return env, true, nil
}

// binaryCloudEvent decodes a binary-mode CloudEvent from the headers and the
// body. ok is false when the headers hold no ce specversion and id.
func (d Decoder) binaryCloudEvent(body []byte, headers map[string]string) (env Envelope, ok bool, err error) {
	attrs := make(map[string]string)
	for k, v := range headers {
		lk := strings.ToLower(k)
		for _, p := range headerPrefixes {
			if name, found := strings.CutPrefix(lk, p); found {
				attrs[name] = v
				break
			}
		}
	}
	if attrs[ceSpecVersion] == "" || attrs[ceID] == "" {
		return Envelope{}, false, nil
	}
	if !strings.HasPrefix(attrs[ceSpecVersion], "1.") {
		return Envelope{}, true, refuse("cloudevents specversion", "not 1.x")
	}
	for _, name := range []string{ceSource, ceType, ceTime} {
		if attrs[name] == "" {
			return Envelope{}, true, refuse("cloudevents "+name, "missing")
		}
	}
	data := json.RawMessage(body)
	if len(body) == 0 {
		data = json.RawMessage("null")
	} else if !json.Valid(body) {
		return Envelope{}, true, refuse("cloudevents data", "not one JSON value (binary mode)")
	}
	env, err = d.cloudEnvelope(ForeignID{ID: attrs[ceID], Source: attrs[ceSource], Type: attrs[ceType], Data: data}, attrs[ceTime])
	return env, true, err
}

// cloudEnvelope maps validated CloudEvents attributes to an envelope.
func (d Decoder) cloudEnvelope(f ForeignID, at string) (Envelope, error) {
	t, err := parseRFC3339(at)
	if err != nil {
		return Envelope{}, &DecodeError{Field: "cloudevents time", Reason: err.Error(), cause: err}
	}
	id, reason, cause := parseEventID(f.ID)
	switch {
	case reason == "":
	case errors.Is(cause, ErrNilEventID):
		return Envelope{}, &DecodeError{Field: "cloudevents id", Reason: reason, cause: cause}
	case d.ClaimKey == nil:
		return Envelope{}, refuse("cloudevents id", reason+"; set Decoder.ClaimKey to derive a claim key")
	default:
		id, err = d.ClaimKey(f)
		if err != nil {
			return Envelope{}, &DecodeError{Field: "cloudevents id", Reason: fmt.Sprintf("ClaimKey: %v", err), cause: err}
		}
		if id == uuid.Nil {
			return Envelope{}, &DecodeError{Field: "cloudevents id", Reason: "ClaimKey gave the nil UUID", cause: ErrNilEventID}
		}
	}
	return Envelope{EventID: id, EventName: f.Type, OccurredAt: t, occurredAtText: at, Payload: f.Data}, nil
}
