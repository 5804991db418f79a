// Package wire holds what the envelope adapters (package marshaler and its
// transport subpackages) and the consumer agree on about the wire but do
// not export.
package wire

import (
	"fmt"
	"strconv"
	"strings"
)

// EnvelopeHeader is the header every adapter publishes with an envelope
// body (marshaler.EncodeMessage), value "1". An adapter decoding the body
// drops it with the other reserved keys (marshaler.ReservedKey); a
// subscriber whose unmarshaler is Watermill's default instead keeps it in
// the metadata and hands on the envelope as the payload, which the consumer
// then holds as a configuration error instead of running the handler on it.
const EnvelopeHeader = "idempotency_envelope"

// UncountedDelivery is the metadata key, value "true", that an adapter sets
// on a delivery its transport could have counted and did not: a Redis
// Streams entry read without redisstream.CountingClient, which alone sees
// whether an entry is a first read or a claim. Under its crash bound the
// consumer counts every attempt of such a delivery, one at a time, as it
// does a marked redelivery: a restarted consumer reads new entries before
// it claims the pending entry that killed the last one, so the first
// attempts after a start (Kafka's count) would miss it. Reserved
// (marshaler.ReservedKey): no incoming header sets it.
const UncountedDelivery = "idempotency_uncounted_delivery"

// Position is the metadata key an adapter sets on every delivery of a
// transport that marks no redelivery but delivers each partition's records
// in order, side by side with other partitions' (marshaler/kafka). Its
// value is "<partition>/<offset>": the partition is the text before the
// last "/" (Kafka: "<topic>/<partition>"), the offset a decimal int64. The
// consumer counts the crashes of an attempt of an event not processed yet
// unless this process has just committed an attempt of a new event at the
// record before it (offset − 1) on its partition: after a restart, the
// record that killed the last consumer never follows such a commit. Those
// counted attempts run one at a time in the process.
// Reserved (marshaler.ReservedKey): no incoming header sets it.
const Position = "idempotency_position"

// ParsePosition splits a Position value into its partition and offset; ok
// is false for any other text.
func ParsePosition(v string) (partition string, offset int64, ok bool) {
	i := strings.LastIndexByte(v, '/')
	if i <= 0 {
		return "", 0, false
	}
	off, err := strconv.ParseInt(v[i+1:], 10, 64)
	if err != nil || off < 0 {
		return "", 0, false
	}
	return v[:i], off, true
}

// DeliveryScoped reports whether key describes the delivery received
// rather than the message: the redelivered flag and the delivery count
// (marshaler.MetadataRedelivered, marshaler.MetadataDeliveryCount),
// UncountedDelivery and Position. A message sent on (a dead-letter
// copy, a republish: marshaler.EncodeMessage and the chain's poison copy)
// goes without them (WithoutDelivery; operation.RouteUncertain's copy and
// the outbox's rows too): on a transport without an adapter to drop reserved
// keys (GoChannel, the watermill-sql subscriber) the next consumer would
// otherwise take each of its attempts for a redelivery of the old one.
func DeliveryScoped(key string) bool {
	switch key {
	case "redelivered", "delivery_count", UncountedDelivery, Position:
		return true
	}
	return false
}

// WithoutDelivery returns md without its DeliveryScoped keys: md itself
// when it has none, else a copy (md is never changed). For the metadata of
// a message sent on: a routed copy, a row of the outbox.
func WithoutDelivery(md map[string]string) map[string]string {
	for k := range md {
		if DeliveryScoped(k) {
			out := make(map[string]string, len(md))
			for k, v := range md {
				if !DeliveryScoped(k) {
					out[k] = v
				}
			}
			return out
		}
	}
	return md
}

// Bound returns s when it has at most max bytes, and otherwise its longest
// prefix that ends on a UTF-8 boundary followed by "…(truncated, N bytes)"
// (N is len(s)): max bytes or fewer in all when max is at least 64 (a max
// below the suffix keeps the suffix alone). A header value the library adds
// to a message goes through it: a broker refuses a header larger than its
// frame (RabbitMQ's frame_max, 128 KiB by default, closes the channel), so
// an unbounded value would fail the publish on every redelivery.
func Bound(s string, max int) string {
	if len(s) <= max {
		return s
	}
	suffix := fmt.Sprintf("…(truncated, %d bytes)", len(s))
	cut := max - len(suffix)
	if cut < 0 {
		cut = 0
	}
	for cut > 0 && s[cut]&0xc0 == 0x80 {
		cut--
	}
	return s[:cut] + suffix
}
