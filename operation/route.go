package operation

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/wire"
)

// Metadata keys RouteUncertain sets on the message it sends to the
// reconciliation topic.
const (
	// MetadataKey is the operation key's text (ParseKey reads it back).
	MetadataKey = "operation_key"
	// MetadataKind is the key's kind.
	MetadataKind = "operation_kind"
	// MetadataReference is the provider's reference, when one is known.
	MetadataReference = "operation_reference"
	// MetadataAttempts is the number of attempts that took the key.
	MetadataAttempts = "operation_attempts"
	// MetadataReason is the UncertainError's text.
	MetadataReason = "operation_uncertain_reason"
)

// maxRouteHeaderBytes bounds the reference and the reason RouteUncertain
// sets (wire.Bound: cut on a rune boundary, saying so), as the consumer
// bounds its poison headers (middleware.DefaultMaxHeaderBytes): an error
// carrying a provider's whole response would otherwise exceed the broker's
// frame, fail the publish on every redelivery and loop.
const maxRouteHeaderBytes = 4096

// RouteUncertain returns a handler middleware that sends a message whose
// handler failed with an UncertainError needing reconciliation
// (NeedsReconciliation) to topic on pub, with the Metadata* keys above added
// to a copy of the message (same UUID, payload and metadata; the reference
// and the reason cut to 4 KiB, saying so), and then
// reports success, so the router acks it: it is not retried and does not
// reach the poison topic. Messages the handler returned are dropped with the
// failed attempt. Every other outcome passes through unchanged.
//
// Where it goes: inside the poison middleware (which would otherwise take
// the permanent error first) and outside the idempotent middleware (so the
// attempt's transaction has rolled back and the event is not marked
// processed: once the operation is resolved, the same event can be replayed
// and completes with the recorded result): middleware.ConsumerConfig.AfterPoison.
//
//	route, _ := operation.RouteUncertain(pub, "billing.reconcile", logger)
//	cfg.AfterPoison = []message.HandlerMiddleware{route} // cfg: middleware.ConsumerConfig
//	c, _ := middleware.NewConsumer(cfg, logger)          // poison, route, retry, recoverer, claim
//
// If the publish fails, the handler's outcome is replaced by a transient
// error (the message is nacked and comes back; the operation is not called
// again, it is still uncertain). Delivery to the topic is at least once: a
// redelivery of the same message before the operation is resolved sends it
// again, so the topic's consumer should deduplicate by MetadataKey.
func RouteUncertain(pub message.Publisher, topic string, logger watermill.LoggerAdapter) (message.HandlerMiddleware, error) {
	if pub == nil {
		return nil, errors.New("operation: RouteUncertain: nil publisher")
	}
	if topic == "" {
		return nil, errors.New("operation: RouteUncertain: empty topic")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			var u *UncertainError
			if err == nil || !errors.As(err, &u) || u.Retry {
				return produced, err
			}
			out := msg.Copy()
			// The keys of the delivery received stay with it: the
			// reconciliation topic's consumer would take its first
			// delivery for a redelivery of this one.
			out.Metadata = wire.WithoutDelivery(out.Metadata)
			out.Metadata.Set(MetadataKey, u.Key)
			out.Metadata.Set(MetadataKind, u.Kind)
			if u.Reference != "" {
				out.Metadata.Set(MetadataReference, wire.Bound(u.Reference, maxRouteHeaderBytes))
			}
			out.Metadata.Set(MetadataAttempts, strconv.Itoa(u.Attempts))
			out.Metadata.Set(MetadataReason, wire.Bound(u.Error(), maxRouteHeaderBytes))
			fields := watermill.LogFields{"message_uuid": msg.UUID, "key": u.Key, "topic": topic}
			if perr := pub.Publish(topic, out); perr != nil {
				logger.Error("Cannot route uncertain operation to the reconciliation topic", perr, fields)
				return nil, &transientError{fmt.Errorf("operation %s: route to %s: %w (outcome: %v)", u.Key, topic, perr, err)}
			}
			logger.Info("Uncertain operation routed to the reconciliation topic", fields)
			return nil, nil
		}
	}, nil
}
