// Package redisstream is the Redis Streams adapter of the envelope for
// watermill-redisstream: [Marshaler] implements its MarshallerUnmarshaller
// and decodes with [marshaler.Decoder], so it never fails on foreign or
// malformed entries.
//
// Why never fail: watermill-redisstream v1.4 returns from its read loop when
// Unmarshal fails ("message unmarshal failed"): one entry without a Watermill
// UUID (an XADD by another producer, a half-written entry) stops the whole
// subscription, and the next valid event is never processed. Here such an
// entry becomes a message flagged [marshaler.MetadataMalformed], which the
// middleware dead-letters once and acks (XACK), and the next entry follows.
//
// The entry layout is watermill-redisstream's own, so either side may use
// its DefaultMarshallerUnmarshaller: field _watermill_message_uuid (the
// canonical event id), field payload (the envelope), field metadata (the
// metadata as a msgpack map).
//
// Deduplication notes for Redis Streams:
//
//   - Redis does not deduplicate: every XADD appends an entry with a new
//     entry id (<ms>-<seq>), so an outbox relay republish is a second entry.
//     Entry ids identify entries, not events; the middleware claims the event
//     id in the envelope.
//   - Within a consumer group an entry read but not acked stays in the
//     group's pending entries list (PEL); watermill-redisstream claims
//     entries idle longer than MaxIdleTime (XCLAIM, which increments the
//     entry's delivery count) and hands them to a consumer again: that is the
//     redelivery after a crash or a lost ack. Two groups each get every entry:
//     two consumers, two claim names.
//   - The delivery count (XPENDING's times-delivered) reaches the
//     middleware only through [CountingClient]: the watermill-redisstream
//     Unmarshaller gets only the entry's fields, not its id nor its
//     pending-list record. Give the Subscriber CountingClient(client) and
//     [marshaler.MetadataRedelivered] and [marshaler.MetadataDeliveryCount]
//     are set (first read: not redelivered, 0; claim: redelivered, the
//     earlier deliveries). Without it they are absent, the entry is marked
//     uncounted, and the consumer's crash bound
//     (middleware.ConsumerConfig.MaxCrashes, on by default) counts every
//     attempt, one at a time in the process (two writes more per delivery;
//     logged once): a restarted consumer reads new entries before it claims
//     the one that killed the last, so only counting every attempt bounds
//     the loop. A Nack makes
//     watermill-redisstream resend the same message in process, not
//     through Redis (no count).
//   - MAXLEN/MINID trimming deletes entries whether or not they were
//     processed, pending ones included: size the stream for the longest
//     consumer outage.
package redisstream

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/vmihailenco/msgpack"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Entry field names, the same as watermill-redisstream's default marshaller.
const (
	// fieldUUID holds the canonical event id: watermill-redisstream's
	// redisstream.UUIDHeaderKey.
	fieldUUID = redisstream.UUIDHeaderKey
	// FieldPayload holds the envelope.
	FieldPayload = "payload"
	// FieldMetadata holds the metadata as a msgpack map of strings.
	FieldMetadata = "metadata"
)

// Marshaler is the watermill-redisstream [redisstream.MarshallerUnmarshaller]
// that puts messages in the JSON envelope. The zero value is ready to use;
// set it as the Marshaller of the PublisherConfig and the Unmarshaller of the
// SubscriberConfig.
type Marshaler struct {
	// Decoder decodes received entries; its MaxSize (0: the default) is also
	// the largest envelope Marshal publishes.
	Decoder marshaler.Decoder
}

var _ redisstream.MarshallerUnmarshaller = Marshaler{}

// Marshal turns msg into the fields of one stream entry: fieldUUID, the
// event id (for a malformed dead-letter copy: msg.UUID), FieldPayload, the
// body of [marshaler.EncodeMessage], and FieldMetadata, its headers as
// msgpack. It returns the errors of [marshaler.EncodeMessage].
func (m Marshaler) Marshal(_ string, msg *message.Message) (map[string]interface{}, error) {
	body, meta, err := marshaler.EncodeMessage(msg, m.Decoder.MaxSize)
	if err != nil {
		return nil, err
	}
	id := msg.UUID
	if _, malformed := marshaler.Malformed(msg); !malformed {
		canonical, _ := marshaler.ParseEventID(msg.UUID) // EncodeMessage checked it
		id = canonical.String()
	}
	md, err := msgpack.Marshal(meta)
	if err != nil {
		return nil, fmt.Errorf("redisstream: metadata: %w", err)
	}
	return map[string]interface{}{fieldUUID: id, FieldPayload: body, FieldMetadata: md}, nil
}

// Unmarshal turns the fields of one stream entry into a message. It never
// returns an error.
//
// FieldPayload is decoded by [marshaler.Decoder.DecodeDelivery], with the
// FieldMetadata map (msgpack, as watermill-redisstream writes it) as headers
// and fieldUUID as the transport id. An entry without FieldPayload, or whose
// metadata does not decode, is flagged malformed; its payload is then the
// entry's fields rendered as a JSON object (sorted keys), so the dead-letter
// copy shows what was received.
func (m Marshaler) Unmarshal(values map[string]interface{}) (msg *message.Message, _ error) {
	defer func() {
		if r := recover(); r != nil {
			msg = marshaler.NewMalformed(entryJSON(values), "", fmt.Sprintf("redisstream: internal error decoding the entry: %v", r))
		}
	}()
	mark := takeDeliveries(values)
	id := fieldText(values[fieldUUID])
	raw, ok := values[FieldPayload]
	if !ok {
		return marshaler.NewMalformed(entryJSON(values), id, "redisstream: entry has no "+FieldPayload+" field"), nil
	}
	in := marshaler.Delivery{Body: []byte(fieldText(raw)), TransportID: id}
	if md := fieldText(values[FieldMetadata]); md != "" {
		if err := msgpack.Unmarshal([]byte(md), &in.Headers); err != nil {
			return marshaler.NewMalformed(entryJSON(values), id, "redisstream: "+FieldMetadata+" field is not a msgpack map of strings"), nil
		}
	}
	msg = m.Decoder.DecodeDelivery(in)
	mark(msg)
	return msg, nil
}

// fieldText renders an entry field: go-redis gives strings; a hand-built map
// may hold bytes or other values.
func fieldText(v interface{}) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	default:
		return fmt.Sprint(v)
	}
}

// entryJSON renders the fields as a JSON object with sorted keys.
func entryJSON(values map[string]interface{}) []byte {
	out := make(map[string]string, len(values))
	for k, v := range values {
		out[k] = fieldText(v)
	}
	b, err := json.Marshal(out) // encoding/json sorts map keys
	if err != nil {
		return nil
	}
	return b
}
