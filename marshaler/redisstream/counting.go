package redisstream

import (
	"context"
	"strconv"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// fieldDeliveries is the entry field CountingClient adds to each entry it
// reads: the entry's earlier deliveries in the consumer group, in decimal
// ("0" for an entry read for the first time), or "redelivered" when it was
// claimed without its count being known. [Marshaler.Unmarshal] maps it to
// [marshaler.MetadataDeliveryCount] and [marshaler.MetadataRedelivered].
const fieldDeliveries = "_idempotency_deliveries"

// pendingLimit bounds the delivery counts CountingClient remembers between
// XPENDING and XCLAIM; past it they are forgotten (a claim then marks the
// entry redelivered without a count).
const pendingLimit = 4096

// CountingClient wraps the client of a watermill-redisstream Subscriber (in
// a consumer group) so that each delivery carries the Redis Streams
// delivery count to the middleware: an entry read for the first time
// (XREADGROUP ">") is marked as such, and an entry claimed from the pending
// entries list (XCLAIM, watermill-redisstream's only redelivery: after a
// consumer died or did not ack within MaxIdleTime) is marked redelivered,
// with the times-delivered count XPENDING reported before the claim (the
// claim is one more delivery). [Marshaler] maps the mark to
// [marshaler.MetadataRedelivered] and [marshaler.MetadataDeliveryCount]; the
// consumer then counts crashes from the first redelivery only
// (middleware.ConsumerConfig.MaxCrashes) and a first delivery writes
// nothing. Without it the transport marks nothing and the consumer counts
// the first attempts after each start. The mark is an extra field of the
// returned entry, written by this client on every read it wraps (an entry
// field of that name stored by a producer is overwritten). Other commands
// pass through unchanged.
func CountingClient(c redis.UniversalClient) redis.UniversalClient {
	return &countingClient{UniversalClient: c, pending: make(map[string]int64)}
}

type countingClient struct {
	redis.UniversalClient
	mu      sync.Mutex
	pending map[string]int64 // stream + "\x00" + entry id → times delivered, from XPENDING
}

func pendingKey(stream, id string) string { return stream + "\x00" + id }

func (c *countingClient) XPendingExt(ctx context.Context, a *redis.XPendingExtArgs) *redis.XPendingExtCmd {
	cmd := c.UniversalClient.XPendingExt(ctx, a)
	if cmd.Err() == nil {
		c.mu.Lock()
		if len(c.pending)+len(cmd.Val()) > pendingLimit {
			clear(c.pending)
		}
		for _, p := range cmd.Val() {
			c.pending[pendingKey(a.Stream, p.ID)] = p.RetryCount
		}
		c.mu.Unlock()
	}
	return cmd
}

func (c *countingClient) XClaim(ctx context.Context, a *redis.XClaimArgs) *redis.XMessageSliceCmd {
	cmd := c.UniversalClient.XClaim(ctx, a)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range a.Messages {
		k := pendingKey(a.Stream, id)
		n, known := c.pending[k]
		delete(c.pending, k)
		for _, m := range cmd.Val() {
			if m.ID != id || m.Values == nil {
				continue
			}
			if known && n > 0 {
				m.Values[fieldDeliveries] = strconv.FormatInt(n, 10)
			} else {
				m.Values[fieldDeliveries] = "redelivered"
			}
		}
	}
	return cmd
}

func (c *countingClient) XReadGroup(ctx context.Context, a *redis.XReadGroupArgs) *redis.XStreamSliceCmd {
	cmd := c.UniversalClient.XReadGroup(ctx, a)
	// Streams is the stream names, then one start id per stream: ">" reads
	// entries never delivered to the group, any other id re-reads this
	// consumer's pending ones.
	half := len(a.Streams) / 2
	for _, s := range cmd.Val() {
		first := false
		for i := 0; i < half; i++ {
			if a.Streams[i] == s.Stream {
				first = a.Streams[half+i] == ">"
			}
		}
		for _, m := range s.Messages {
			if m.Values == nil {
				continue
			}
			if first {
				m.Values[fieldDeliveries] = "0"
			} else {
				m.Values[fieldDeliveries] = "redelivered"
			}
		}
	}
	return cmd
}

// setDeliveries maps the CountingClient mark of an entry to msg's metadata.
func setDeliveries(msg *message.Message, values map[string]interface{}) {
	v, ok := values[fieldDeliveries]
	if !ok {
		return
	}
	s := fieldText(v)
	if n, err := strconv.ParseInt(s, 10, 64); err == nil && n >= 0 {
		marshaler.SetRedelivered(msg, n > 0)
		marshaler.SetDeliveryCount(msg, n)
		return
	}
	marshaler.SetRedelivered(msg, true)
}
