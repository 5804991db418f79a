package redisstream

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmredis "github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Two watermill-redisstream subscribers of one stream in two consumer
// groups (two consumers of one process, e.g. "stock" and "billing") share
// one CountingClient, as the crash-loop wiring shares its client between
// subscriber and publisher. The process died holding the entry in both
// groups: Redis counts 1 delivery in g1 and 3 in g2. At restart both
// subscribers' initial claims run; when their XPENDING/XCLAIM pairs
// interleave (forced here through ShouldClaimPendingMessage, which runs
// between them), each claim must still carry its own group's count
// (transports.md: "claims (XCLAIM …) as redelivered with the entry's
// earlier deliveries in its group").
func TestCountingClientClaimCarriesItsOwnGroupsDeliveryCount(t *testing.T) {
	ctx := context.Background()
	raw, stream := rawStream(t, "claimcount-groups")
	id := addEntry(t, raw, stream, event(t), nil)
	for _, g := range []string{"g1", "g2"} {
		require.NoError(t, raw.XGroupCreate(ctx, stream, g, "0").Err())
	}
	// g1: delivered once (to a consumer that died).
	require.NoError(t, raw.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g1", Consumer: "dead1", Streams: []string{stream, ">"}, Count: 1}).Err())
	// g2: delivered three times (read, then claimed twice by consumers that died).
	require.NoError(t, raw.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g2", Consumer: "dead2", Streams: []string{stream, ">"}, Count: 1}).Err())
	for _, c := range []string{"dead3", "dead4"} {
		require.NoError(t, raw.XClaim(ctx, &redis.XClaimArgs{Stream: stream, Group: "g2", Consumer: c, Messages: []string{id}}).Err())
	}
	// Wait (no assertion on time) until both pending entries are idle ≥ 1 ms.
	for _, g := range []string{"g1", "g2"} {
		for {
			p, err := raw.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: g, Idle: time.Millisecond, Start: "-", End: "+", Count: 10}).Result()
			require.NoError(t, err)
			if len(p) == 1 {
				break
			}
		}
	}
	want := map[string]int64{"g1": 1, "g2": 3}
	for g, n := range want {
		p, err := raw.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: g, Start: "-", End: "+", Count: 10}).Result()
		require.NoError(t, err)
		require.Equal(t, n, p[0].RetryCount, "Redis's count in %s", g)
	}

	shared := CountingClient(redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()}))
	g1Listed, g2Listed, g1Got := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once1, once2 sync.Once
	newSub := func(group string, should func(redis.XPendingExt) bool) *wmredis.Subscriber {
		sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
			Client: shared, Unmarshaller: Marshaler{}, ConsumerGroup: group, Consumer: "live-" + group,
			MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour, CheckConsumersInterval: time.Hour,
			ShouldClaimPendingMessage: should,
		}, watermill.NopLogger{})
		require.NoError(t, err)
		return sub
	}
	// g1 lists its pending entry (XPENDING), then waits for g2 to list its own
	// before it claims; g2 claims after g1's claim arrived.
	sub1 := newSub("g1", func(redis.XPendingExt) bool {
		once1.Do(func() { close(g1Listed) })
		<-g2Listed
		return true
	})
	sub2 := newSub("g2", func(redis.XPendingExt) bool {
		once2.Do(func() { close(g2Listed) })
		<-g1Got
		return true
	})
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out1, err := sub1.Subscribe(subCtx, stream)
	require.NoError(t, err)
	<-g1Listed
	out2, err := sub2.Subscribe(subCtx, stream)
	require.NoError(t, err)

	got := map[string]*message.Message{}
	m1 := <-out1
	m1.Ack()
	got["g1"] = m1
	close(g1Got)
	m2 := <-out2
	m2.Ack()
	got["g2"] = m2
	cancel()
	_ = sub1.Close()
	_ = sub2.Close()

	for _, g := range []string{"g1", "g2"} {
		n, ok := marshaler.DeliveryCount(got[g])
		require.True(t, marshaler.Redelivered(got[g]), "%s: claimed, so redelivered", g)
		require.True(t, ok, "%s: a claim carries the count XPENDING reported (metadata %v)", g, got[g].Metadata)
		require.Equal(t, want[g], n, "%s: the claim carries its own group's delivery count, not another group's", g)
	}
}

// One group, one CountingClient per subscriber (the documented wiring).
// watermill-redisstream lists a batch of idle pending entries (XPENDING)
// and then claims them one by one, each claim waiting until the handler has
// taken the previous one (its read channel holds one entry), so a claim can
// come long after the listing. Meanwhile another consumer of the group
// claimed the entry and died (Redis's count went up, the entry went idle
// again). The claim must carry the count the entry had when it was claimed,
// not the listing's: the count bounds the crashes counted.
func TestCountingClientClaimCarriesTheCountAtTheClaimNotAtTheListing(t *testing.T) {
	ctx := context.Background()
	raw, stream := rawStream(t, "claimcount-stale")
	id := addEntry(t, raw, stream, event(t), nil)
	require.NoError(t, raw.XGroupCreate(ctx, stream, "g", "0").Err())
	require.NoError(t, raw.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead1", Streams: []string{stream, ">"}, Count: 1}).Err())
	waitIdle := func() {
		for {
			p, err := raw.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: "g", Idle: time.Millisecond, Start: "-", End: "+", Count: 10}).Result()
			require.NoError(t, err)
			if len(p) == 1 {
				return
			}
		}
	}
	waitIdle()

	var once sync.Once
	sub, err := wmredis.NewSubscriber(wmredis.SubscriberConfig{
		Client: CountingClient(redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})), Unmarshaller: Marshaler{},
		ConsumerGroup: "g", Consumer: "live", MaxIdleTime: time.Millisecond, ClaimInterval: time.Hour, CheckConsumersInterval: time.Hour,
		// Runs between the listing and the claim: another consumer claims the
		// entry there and dies holding it (Redis's count 1 → 2).
		ShouldClaimPendingMessage: func(redis.XPendingExt) bool {
			once.Do(func() {
				require.NoError(t, raw.XClaim(ctx, &redis.XClaimArgs{Stream: stream, Group: "g", Consumer: "dead2", Messages: []string{id}}).Err())
				waitIdle()
			})
			return true
		},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out, err := sub.Subscribe(subCtx, stream)
	require.NoError(t, err)
	m := <-out
	m.Ack()
	cancel()
	_ = sub.Close()

	n, ok := marshaler.DeliveryCount(m)
	require.True(t, ok)
	require.Equal(t, int64(2), n, "delivered to dead1 and dead2 before this claim")
}
