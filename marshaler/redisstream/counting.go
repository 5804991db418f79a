package redisstream

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// fieldDeliveries is the entry field CountingClient adds to each entry it
// reads: the entry's earlier deliveries in the consumer group, in decimal
// ("0" for an entry read for the first time), or "redelivered" when it was
// claimed without its count being known. [Marshaler.Unmarshal] maps it to
// [marshaler.MetadataDeliveryCount] and [marshaler.MetadataRedelivered] and
// removes it. Its name ends with a random suffix drawn at start, so an
// entry stored by a producer cannot carry it: it exists only in the
// entries this process's CountingClient returns.
var fieldDeliveries = "_idempotency_deliveries." + randomSuffix()

func randomSuffix() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24)
	return hex.EncodeToString(b[:])
}

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
// with the entry's earlier deliveries in its group: the times-delivered
// count XPENDING reports for it right after the claim, less the claim (or,
// when that read fails, the count the subscriber's own XPENDING listing
// reported for that group before the claim). [Marshaler] maps the mark to
// [marshaler.MetadataRedelivered] and [marshaler.MetadataDeliveryCount]; the
// consumer then counts crashes from the first redelivery only
// (middleware.ConsumerConfig.MaxCrashes) and a first delivery writes
// nothing. A subscriber without a consumer group (fan-out: XREAD, no
// pending list, no claim) gets its entries marked as read without a count:
// the consumer counts a start's first attempts, as on Kafka. Without
// CountingClient the Marshaler marks each entry uncounted, and a consumer
// whose crash bound is on counts every attempt, one at a time (see the
// package doc). The mark is an extra field of the
// returned entry, under a name drawn at random when the process starts (a
// producer cannot forge it). Other commands pass through unchanged. The mark is in memory only: no entry stored in
// Redis is changed.
//
// It also keeps the entries it handed out from being claimed while they
// are being handled: watermill-redisstream's claim loop (XPENDING with
// Idle: MaxIdleTime, then XCLAIM) takes any entry idle that long, its own
// subscriber's and a live member's alike, so an attempt longer than
// MaxIdleTime (a slow handler, the consumer's retries or its hold through
// an outage) was run again beside itself and a permanent failure
// dead-lettered more than once. Before each such listing, CountingClient
// claims its own entries in flight (handed out by it, not yet XACKed, for
// at most inFlightFor) to their consumer again (XCLAIM JUSTID: the idle
// time restarts, the delivery count does not move), so only the entries
// of a member that stopped handling them (it died, or its subscriber
// closed) reach MaxIdleTime. Keep ClaimInterval below MaxIdleTime
// (watermill-redisstream's defaults: 1 s and 60 s).
func CountingClient(c redis.UniversalClient) redis.UniversalClient {
	return &countingClient{UniversalClient: c, pending: make(map[string]int64), inFlight: make(map[inFlightKey]handed)}
}

type countingClient struct {
	redis.UniversalClient
	mu      sync.Mutex
	pending map[string]int64 // stream, group and entry id → times delivered, from XPENDING
	// inFlight: the entries this client handed out to a consumer of a
	// group and not seen XACKed, with to whom and when.
	inFlight map[inFlightKey]handed
}

// inFlightKey is an entry of group on stream.
type inFlightKey struct{ stream, group, id string }

// handed is to which consumer an entry was handed out, and when.
type handed struct {
	consumer string
	at       time.Time
}

// inFlightFor bounds how long an entry handed out and not XACKed is kept
// from being claimed: past it (an attempt that long, or a subscriber
// closed in a process that lives on) it is claimable after MaxIdleTime as
// any other. Above the consumer's longest hold (middleware.DefaultMaxHold,
// 25 min).
const inFlightFor = 30 * time.Minute

// handedOut records msgs as in flight with consumer.
func (c *countingClient) handedOut(stream, group, consumer string, msgs []redis.XMessage) {
	if group == "" || len(msgs) == 0 {
		return
	}
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		c.inFlight[inFlightKey{stream, group, m.ID}] = handed{consumer, now}
	}
}

// XAck ends the entries' handling: they are no longer in flight.
func (c *countingClient) XAck(ctx context.Context, stream, group string, ids ...string) *redis.IntCmd {
	cmd := c.UniversalClient.XAck(ctx, stream, group, ids...)
	c.mu.Lock()
	for _, id := range ids {
		delete(c.inFlight, inFlightKey{stream, group, id})
	}
	c.mu.Unlock()
	return cmd
}

// refresh claims the entries of stream and group in flight to their
// consumer again (XCLAIM JUSTID, MinIdle 0): their idle time restarts, so
// a claim loop's listing of idle entries leaves them out. An error leaves
// them as they are (claimable after MaxIdleTime, as without it).
func (c *countingClient) refresh(ctx context.Context, stream, group string) {
	byConsumer := map[string][]string{}
	now := time.Now()
	c.mu.Lock()
	for k, h := range c.inFlight {
		switch {
		case now.Sub(h.at) > inFlightFor:
			delete(c.inFlight, k)
		case k.stream == stream && k.group == group:
			byConsumer[h.consumer] = append(byConsumer[h.consumer], k.id)
		}
	}
	c.mu.Unlock()
	for consumer, ids := range byConsumer {
		c.UniversalClient.XClaimJustID(ctx, &redis.XClaimArgs{Stream: stream, Group: group, Consumer: consumer, MinIdle: 0, Messages: ids})
	}
}

func pendingKey(stream, group, id string) string { return stream + "\x00" + group + "\x00" + id }

func (c *countingClient) XPendingExt(ctx context.Context, a *redis.XPendingExtArgs) *redis.XPendingExtCmd {
	if a.Idle > 0 {
		// A claim loop's listing of idle entries: restart the idle time
		// of those still being handled first.
		c.refresh(ctx, a.Stream, a.Group)
	}
	cmd := c.UniversalClient.XPendingExt(ctx, a)
	if cmd.Err() == nil {
		c.mu.Lock()
		if len(c.pending)+len(cmd.Val()) > pendingLimit {
			clear(c.pending)
		}
		for _, p := range cmd.Val() {
			c.pending[pendingKey(a.Stream, a.Group, p.ID)] = p.RetryCount
		}
		c.mu.Unlock()
	}
	return cmd
}

func (c *countingClient) XClaim(ctx context.Context, a *redis.XClaimArgs) *redis.XMessageSliceCmd {
	cmd := c.UniversalClient.XClaim(ctx, a)
	c.handedOut(a.Stream, a.Group, a.Consumer, cmd.Val())
	// The count now, after the claim counted itself: another consumer
	// may have claimed the entry since the listing.
	now := make(map[string]int64, len(cmd.Val()))
	for _, m := range cmd.Val() {
		p, err := c.UniversalClient.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: a.Stream, Group: a.Group, Start: m.ID, End: m.ID, Count: 1}).Result()
		if err == nil && len(p) == 1 && p[0].ID == m.ID && p[0].RetryCount > 0 {
			now[m.ID] = p[0].RetryCount - 1
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range a.Messages {
		k := pendingKey(a.Stream, a.Group, id)
		n, known := c.pending[k]
		delete(c.pending, k)
		if m, ok := now[id]; ok {
			n, known = m, true
		}
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
		c.handedOut(s.Stream, a.Group, a.Consumer, s.Messages)
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

// XRead is the read of a subscriber without a consumer group (fan-out):
// no pending list, no claim. A restarted subscriber starts again at its
// configured id and re-reads in order, so its entries are marked as read
// without a count ("fan-out"): the consumer counts a start's first
// attempts, as on Kafka, and never takes them for uncounted.
func (c *countingClient) XRead(ctx context.Context, a *redis.XReadArgs) *redis.XStreamSliceCmd {
	cmd := c.UniversalClient.XRead(ctx, a)
	for _, s := range cmd.Val() {
		for _, m := range s.Messages {
			if m.Values != nil {
				m.Values[fieldDeliveries] = markFanOut
			}
		}
	}
	return cmd
}

// markFanOut is the mark of an entry read without a consumer group.
const markFanOut = "fan-out"

// takeDeliveries removes the CountingClient mark from an entry's fields and
// returns a function that maps it to a decoded message's metadata; an entry
// without the mark is marked uncounted (the consumer then counts each of its
// attempts under its crash bound).
func takeDeliveries(values map[string]interface{}) func(*message.Message) {
	v, ok := values[fieldDeliveries]
	if !ok {
		// Read without CountingClient: whether this is a first read or a
		// claim of a pending entry is unknown.
		return func(msg *message.Message) { msg.Metadata.Set(wire.UncountedDelivery, "true") }
	}
	delete(values, fieldDeliveries)
	if fieldText(v) == markFanOut {
		return func(*message.Message) {}
	}
	return func(msg *message.Message) { setDeliveries(msg, fieldText(v)) }
}

// setDeliveries maps a CountingClient mark to msg's metadata.
func setDeliveries(msg *message.Message, s string) {
	if n, err := strconv.ParseInt(s, 10, 64); err == nil && n >= 0 {
		marshaler.SetRedelivered(msg, n > 0)
		marshaler.SetDeliveryCount(msg, n)
		return
	}
	marshaler.SetRedelivered(msg, true)
}
