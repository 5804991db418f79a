// Package wire holds what the envelope adapters (package marshaler and its
// transport subpackages) and the consumer agree on about the wire but do
// not export.
package wire

// EnvelopeHeader is the header every adapter publishes with an envelope
// body (marshaler.EncodeMessage), value "1". An adapter decoding the body
// drops it with the other reserved keys (marshaler.ReservedKey); a
// subscriber whose unmarshaler is Watermill's default instead keeps it in
// the metadata and hands on the envelope as the payload, which the consumer
// then holds as a configuration error instead of running the handler on it.
const EnvelopeHeader = "idempotency_envelope"
