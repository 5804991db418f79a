package redislatest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

func TestRedisLatestContract(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := testRedis(t)
	r, err := redislatest.New(redislatest.Config{Client: client, Prefix: prefix, TTL: time.Hour})
	require.NoError(t, err)
	require.False(t, r.Transactional())
	f := versioned.Family{Kind: "product.index", ID: "p:1"}
	require.Equal(t, prefix+"13:product.index:p:1", r.Key(f))
	require.NotEqual(t, r.Key(versioned.Family{Kind: "a:b", ID: "c"}), r.Key(versioned.Family{Kind: "a", ID: "b:c"}))

	_, ok, err := r.Latest(ctx, nil, f)
	require.NoError(t, err)
	require.False(t, ok)

	at := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
	older := versioned.TimePosition(at.Add(100*time.Nanosecond), uuid.MustParse(idE6))
	newer := versioned.TimePosition(at.Add(101*time.Nanosecond), uuid.MustParse(idE1))
	numbered := versioned.SeqPosition(0, uuid.MustParse(idE1))
	for _, step := range []struct {
		pos  versioned.Position
		move bool
	}{{older, true}, {newer, true}, {newer, false}, {older, false}, {numbered, true}, {newer, false}} {
		moved, err := r.Advance(ctx, nil, f, step.pos)
		require.NoError(t, err)
		require.Equal(t, step.move, moved, step.pos.String())
	}
	got, ok, err := r.Latest(ctx, nil, f)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, numbered, got)

	// Every Advance (re)sets the TTL, moved or not.
	require.NoError(t, client.PExpire(ctx, r.Key(f), time.Minute).Err())
	moved, err := r.Advance(ctx, nil, f, older)
	require.NoError(t, err)
	require.False(t, moved)
	ttl, err := client.PTTL(ctx, r.Key(f)).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, 59*time.Minute)

	// A value that is no position is an error (the filter fails open on it).
	require.NoError(t, client.Set(ctx, r.Key(f), "zz", time.Minute).Err())
	_, _, err = r.Latest(ctx, nil, f)
	require.ErrorContains(t, err, "redis latest")

	_, err = r.Advance(ctx, nil, versioned.Family{ID: "x"}, newer)
	require.ErrorIs(t, err, versioned.ErrFamilyInvalid)
}

// Concurrent Advance calls on one key: the script's compare-and-set keeps
// the newest position.
func TestRedisLatestConcurrentAdvance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := testRedis(t)
	r, err := redislatest.New(redislatest.Config{Client: client, Prefix: prefix})
	require.NoError(t, err)
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	const n = 200
	var wg sync.WaitGroup
	var mu sync.Mutex
	var newest versioned.Position
	var moves int
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := versioned.SeqPosition(int64(i*37%n), uuid.Must(uuid.NewV7()))
			moved, err := r.Advance(ctx, nil, f, p)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if moved {
				moves++
			}
			if p.After(newest) {
				newest = p
			}
		}()
	}
	wg.Wait()
	got, ok, err := r.Latest(ctx, nil, f)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, newest, got)
	require.GreaterOrEqual(t, moves, 1)
	ttl, err := client.PTTL(ctx, r.Key(f)).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, redislatest.DefaultTTL-time.Minute, "default TTL")
}

func TestRedisLatestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := redislatest.New(redislatest.Config{})
	require.ErrorContains(t, err, "Config.Client")
	client, _ := testRedis(t)
	_, err = redislatest.New(redislatest.Config{Client: client, TTL: time.Microsecond})
	require.ErrorContains(t, err, "Config.TTL")
	r, err := redislatest.New(redislatest.Config{Client: client})
	require.NoError(t, err)
	require.Equal(t, redislatest.DefaultPrefix+"1:k:i", r.Key(versioned.Family{Kind: "k", ID: "i"}))
}
