// Package jetstream is the NATS JetStream adapter of the envelope for
// watermill-nats v2: [Marshaler] implements the Marshaler and Unmarshaler of
// its pkg/nats (the JetStream mode of nats.Publisher and nats.Subscriber), and
// [Unmarshaler] the Unmarshaler of its pkg/jetstream. Both decode with
// [marshaler.Decoder], so they never fail on foreign or malformed input.
//
// Why never fail: watermill-nats v2.1.3 pkg/nats logs an Unmarshal error and
// returns without acking or nacking, so JetStream redelivers the message every
// AckWait, forever (until MaxDeliver); pkg/jetstream dereferences the nil
// message it got with the error. Here a body that is not an envelope becomes
// a message flagged [marshaler.MetadataMalformed], which the middleware
// dead-letters once and acks.
//
// Consuming: [NewSubscriber] is the recommended configuration as code, a
// message.Subscriber on nats.go's JetStream push subscriptions: a durable push consumer created by this package and never deleted by a
// shutdown, explicit acks sent only after the attempt's outcome, a short
// AckWait kept alive by in-progress acks while a handler holds a delivery,
// and a watch that notices the durable consumer deleted or replaced under
// the running service (jsm.go#101).
//
// Publishing: [NewPublisher] is the publisher of everything on JetStream:
// the outbox relay's destination, dead letters (the poison destination),
// redrives and replays. [Publisher] gives each publish a Nats-Msg-Id of its
// own (every message given is stored as a new one: a relay's republish is
// not dropped by the duplicate window, the consumer's claim skips it),
// reads the PubAck, and tells JetStream's refusals apart for the relay: a
// full stream (DiscardNew), storage or memory exhausted and a missing
// PubAck are back-pressure (never counted against a row); a subject no
// stream takes is unroutable (the row waits for a stream). The relay's probe
// ("outbox.probe" by default) needs no stream: unroutable, it shows the
// server up.
//
// Deduplication notes for JetStream:
//
//   - JetStream drops a publish whose Nats-Msg-Id header it already saw in the
//     stream's duplicate window (StreamConfig.Duplicates, default 2 minutes):
//     the publish succeeds with PubAck.Duplicate set and nothing is stored.
//     Marshal sets Nats-Msg-Id to "<event id>:<subject>", so a producer
//     publishing with watermill-nats' publisher and [Marshaler] has its
//     republish of the same event within the window dropped by the broker,
//     while the same event published to another subject of the same stream (a
//     poison/dead-letter copy) is not. [Publisher] replaces that id with one
//     of its own for every publish. Past the window, a republish is stored
//     again and the middleware's claim is what skips it: the window is an
//     optimisation, never the guarantee.
//   - watermill-nats' JetStreamConfig.TrackMsgId overrides that header with
//     the bare Watermill UUID (the event id here): with it on, a dead-letter
//     copy published within the window to a subject of the same stream is
//     silently dropped. Leave TrackMsgId off, or keep poison subjects in a
//     stream of their own.
//   - Redelivery: a message not acked within AckWait (consumer crash, lost
//     ack, connection cut) is delivered again with NumDelivered + 1; the
//     adapter maps it to [marshaler.MetadataRedelivered] (NumDelivered > 1)
//     and [marshaler.MetadataDeliveryCount] (NumDelivered - 1). The stream
//     sequence identifies a stored copy, not the event: a republish past the
//     window has a new sequence and the same event id.
package jetstream

import (
	"strings"

	wmjetstream "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/jetstream"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Marshaler is the watermill-nats v2 pkg/nats [wmnats.MarshalerUnmarshaler]
// that puts messages in the JSON envelope. The zero value is ready to use; set
// it as the Marshaler of the nats.PublisherConfig and the Unmarshaler of the
// nats.SubscriberConfig (JetStream mode).
type Marshaler struct {
	// Decoder decodes received bodies; its MaxSize (0: the default) is also
	// the largest envelope Marshal publishes.
	Decoder marshaler.Decoder
}

var _ wmnats.MarshalerUnmarshaler = Marshaler{}

// Unmarshaler is the watermill-nats v2 pkg/jetstream [wmjetstream.Unmarshaler]
// (the subscriber built on the nats.go jetstream API). It decodes like
// [Marshaler.Unmarshal]. The zero value is ready to use.
type Unmarshaler struct {
	// Decoder decodes received bodies.
	Decoder marshaler.Decoder
}

var _ wmjetstream.Unmarshaler = Unmarshaler{}

// skippedHeaders are the NATS headers that are publish instructions to the
// server, not message metadata (the same list watermill-nats skips).
var skippedHeaders = map[string]bool{
	wmnats.WatermillUUIDHdr:     true,
	nats.MsgIdHdr:               true,
	nats.ExpectedLastMsgIdHdr:   true,
	nats.ExpectedStreamHdr:      true,
	nats.ExpectedLastSubjSeqHdr: true,
	nats.ExpectedLastSeqHdr:     true,
}

// msgID returns the Nats-Msg-Id Marshal sets for an event published to
// subject: "<event id>:<subject>".
func msgID(eventID, subject string) string { return eventID + ":" + subject }

// Marshal turns msg into a NATS message for subject topic.
//
// The body and headers are those of [marshaler.EncodeMessage] (one header
// value per metadata key). For an ordinary message it also sets
// _watermill_message_uuid (watermill-nats' UUID header) to the canonical
// event id and Nats-Msg-Id to "<event id>:<topic>", for JetStream's
// duplicate window (see the package doc). A message flagged malformed (a
// dead-letter copy) gets no Nats-Msg-Id (the broker must not drop it) and its
// UUID, which identifies the copy and no event, in _watermill_message_uuid;
// its raw body is published verbatim. It returns the errors of
// [marshaler.EncodeMessage].
func (m Marshaler) Marshal(topic string, msg *message.Message) (*nats.Msg, error) {
	body, meta, err := marshaler.EncodeMessage(msg, m.Decoder.MaxSize)
	if err != nil {
		return nil, err
	}
	hdr := make(nats.Header, len(meta)+2)
	for k, v := range meta {
		if !skippedHeaders[k] {
			hdr.Set(k, v)
		}
	}
	if _, malformed := marshaler.Malformed(msg); !malformed {
		id, _ := marshaler.ParseEventID(msg.UUID) // EncodeMessage checked it
		hdr.Set(wmnats.WatermillUUIDHdr, id.String())
		hdr.Set(nats.MsgIdHdr, msgID(id.String(), topic))
	} else if msg.UUID != "" {
		hdr.Set(wmnats.WatermillUUIDHdr, msg.UUID) // names the copy, deduplicates nothing
	}
	return &nats.Msg{Subject: topic, Data: body, Header: hdr}, nil
}

// Unmarshal turns a NATS (JetStream) message into a Watermill message. It
// never returns an error.
//
// The body is decoded by [marshaler.Decoder.DecodeDelivery]; headers become
// metadata (a header with several values is joined with ", "), except the
// server instructions (Nats-Msg-Id, Nats-Expected-*, _watermill_message_uuid)
// and the keys [marshaler.ReservedKey] reports. The UUID of a malformed
// message is the _watermill_message_uuid header, else Nats-Msg-Id, else a
// random id. When nm is a JetStream delivery (its reply subject carries the
// ack metadata), [marshaler.MetadataRedelivered] is NumDelivered > 1 and
// [marshaler.MetadataDeliveryCount] NumDelivered - 1; a core NATS message
// has neither.
func (m Marshaler) Unmarshal(nm *nats.Msg) (*message.Message, error) {
	if nm == nil {
		return marshaler.NewMalformed(nil, "", "jetstream: nil message"), nil
	}
	msg := decode(m.Decoder, nm.Data, nm.Header)
	if md, err := nm.Metadata(); err == nil {
		setDelivery(msg, md.NumDelivered)
	}
	return msg, nil
}

// Unmarshal is [Marshaler.Unmarshal] for a message of the nats.go jetstream
// API. It never returns an error.
func (u Unmarshaler) Unmarshal(jm jetstream.Msg) (*message.Message, error) {
	if jm == nil {
		return marshaler.NewMalformed(nil, "", "jetstream: nil message"), nil
	}
	msg := decode(u.Decoder, jm.Data(), jm.Headers())
	if md, err := jm.Metadata(); err == nil {
		setDelivery(msg, md.NumDelivered)
	}
	return msg, nil
}

func decode(d marshaler.Decoder, body []byte, hdr nats.Header) *message.Message {
	in := marshaler.Delivery{Body: body, Headers: make(map[string]string, len(hdr))}
	for k, vs := range hdr {
		if !skippedHeaders[k] {
			in.Headers[k] = strings.Join(vs, ", ")
		}
	}
	if in.TransportID = hdr.Get(wmnats.WatermillUUIDHdr); in.TransportID == "" {
		in.TransportID = hdr.Get(nats.MsgIdHdr)
	}
	return d.DecodeDelivery(in)
}

func setDelivery(msg *message.Message, numDelivered uint64) {
	if numDelivered == 0 {
		return // not a delivery count
	}
	marshaler.SetRedelivered(msg, numDelivered > 1)
	if n := numDelivered - 1; n <= 1<<62 {
		marshaler.SetDeliveryCount(msg, int64(n))
	}
}
