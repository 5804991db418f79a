package redisstream

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Through CountingClient an entry read for the first time arrives marked
// not redelivered with 0 earlier deliveries, and the same entry claimed
// from the pending list (after a consumer died holding it) arrives marked
// redelivered with the delivery count Redis keeps; a field a producer
// stored cannot pass for the mark, and the mark does not outlive decoding.
func TestCountingClientMarksFirstReadsAndClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw, stream := rawStream(t, "counting")
	addEntry(t, raw, stream, event(t), map[string]string{"_idempotency_deliveries": "7"}) // a producer's attempt at the mark
	require.NoError(t, raw.XGroupCreateMkStream(ctx, stream, "g", "0").Err())

	c := CountingClient(raw)
	read, err := c.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "g", Consumer: "dead", Streams: []string{stream, ">"}, Count: 1}).Result()
	require.NoError(t, err)
	msg, err := Marshaler{}.Unmarshal(read[0].Messages[0].Values)
	require.NoError(t, err)
	require.NotContains(t, read[0].Messages[0].Values, fieldDeliveries, "removed by Unmarshal")
	require.Equal(t, "false", msg.Metadata.Get(marshaler.MetadataRedelivered))
	n, ok := marshaler.DeliveryCount(msg)
	require.True(t, ok)
	require.Zero(t, n)

	// The consumer "dead" never acks; another one claims the entry, as
	// watermill-redisstream's claim loop does: XPENDING, then XCLAIM.
	pending, err := c.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: stream, Group: "g", Start: "-", End: "+", Count: 10}).Result()
	require.NoError(t, err)
	require.Len(t, pending, 1)
	claimed, err := c.XClaim(ctx, &redis.XClaimArgs{Stream: stream, Group: "g", Consumer: "alive", Messages: []string{pending[0].ID}}).Result()
	require.NoError(t, err)
	msg, err = Marshaler{}.Unmarshal(claimed[0].Values)
	require.NoError(t, err)
	require.True(t, marshaler.Redelivered(msg))
	n, ok = marshaler.DeliveryCount(msg)
	require.True(t, ok)
	require.Equal(t, int64(1), n, "delivered once before the claim")
}

// An entry read without CountingClient is marked uncounted (the consumer
// then counts each attempt under its crash bound); one read through it is
// not, and a header stored with the entry cannot set or clear the mark.
func TestEntriesReadWithoutCountingClientAreMarkedUncounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw, stream := rawStream(t, "uncounted")
	ev := event(t)
	ev.Metadata.Set(wire.UncountedDelivery, "true") // a producer's (or a redriven copy's) header
	addEntry(t, raw, stream, ev, nil)
	require.NoError(t, raw.XGroupCreateMkStream(ctx, stream, "plain", "0").Err())
	require.NoError(t, raw.XGroupCreateMkStream(ctx, stream, "counted", "0").Err())

	read, err := raw.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "plain", Consumer: "c", Streams: []string{stream, ">"}, Count: 1}).Result()
	require.NoError(t, err)
	msg, err := Marshaler{}.Unmarshal(read[0].Messages[0].Values)
	require.NoError(t, err)
	require.Equal(t, "true", msg.Metadata.Get(wire.UncountedDelivery), "read by a plain client")

	read, err = CountingClient(raw).XReadGroup(ctx, &redis.XReadGroupArgs{Group: "counted", Consumer: "c", Streams: []string{stream, ">"}, Count: 1}).Result()
	require.NoError(t, err)
	msg, err = Marshaler{}.Unmarshal(read[0].Messages[0].Values)
	require.NoError(t, err)
	require.Empty(t, msg.Metadata.Get(wire.UncountedDelivery), "read through CountingClient: the stored header must not mark it")
	require.Equal(t, "false", msg.Metadata.Get(marshaler.MetadataRedelivered))
}

// A subscriber without a consumer group reads with XREAD (fan-out: no
// pending list, no claim). Through CountingClient its entries carry no
// count and are not taken for uncounted: the consumer counts a start's
// first attempts, as on Kafka. Through a plain client they are uncounted.
func TestFanOutEntriesThroughCountingClientAreNotUncounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw, stream := rawStream(t, "fanout")
	addEntry(t, raw, stream, event(t), nil)

	read, err := CountingClient(raw).XRead(ctx, &redis.XReadArgs{Streams: []string{stream, "0"}, Count: 1}).Result()
	require.NoError(t, err)
	msg, err := Marshaler{}.Unmarshal(read[0].Messages[0].Values)
	require.NoError(t, err)
	_, malformed := marshaler.Malformed(msg)
	require.False(t, malformed)
	require.NotContains(t, msg.Metadata, wire.UncountedDelivery)
	require.NotContains(t, msg.Metadata, marshaler.MetadataRedelivered)
	require.NotContains(t, msg.Metadata, marshaler.MetadataDeliveryCount)

	read, err = raw.XRead(ctx, &redis.XReadArgs{Streams: []string{stream, "0"}, Count: 1}).Result()
	require.NoError(t, err)
	msg, err = Marshaler{}.Unmarshal(read[0].Messages[0].Values)
	require.NoError(t, err)
	require.Equal(t, "true", msg.Metadata.Get(wire.UncountedDelivery))
}

// rawStream returns a plain client and a stream name of the test's own,
// both removed at its end.
func rawStream(t *testing.T, prefix string) (*redis.Client, string) {
	t.Helper()
	raw := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	stream := testenv.UniqueName(prefix)
	t.Cleanup(func() {
		raw.Del(context.Background(), stream)
		_ = raw.Close()
	})
	return raw, stream
}

// addEntry adds msg to stream as Marshaler writes it, with the extra
// fields, and returns the entry's id.
func addEntry(t *testing.T, raw *redis.Client, stream string, msg *message.Message, extra map[string]string) string {
	t.Helper()
	fields, err := Marshaler{}.Marshal(stream, msg)
	require.NoError(t, err)
	for k, v := range extra {
		fields[k] = v
	}
	id, err := raw.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: fields}).Result()
	require.NoError(t, err)
	return id
}
