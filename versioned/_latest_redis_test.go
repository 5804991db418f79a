package versioned_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

func init() {
	redisLatest = func(t testing.TB, ttl time.Duration) (versioned.LatestStore, string, func() int) {
		client, prefix := lfRedis(t)
		store, err := redislatest.New(redislatest.Config{Client: client, Prefix: prefix, TTL: ttl})
		require.NoError(t, err)
		return store, prefix, func() int { return lfDeleteRedisPrefix(t, client, prefix) }
	}
}

// lfRedisAddr is REDIS_URL (redis://… or host:port) or 127.0.0.1:6379.
func lfRedisOptions(t testing.TB) *redis.Options {
	t.Helper()
	u := os.Getenv("REDIS_URL")
	if u == "" {
		return &redis.Options{Addr: "127.0.0.1:6379"}
	}
	if strings.Contains(u, "://") {
		opt, err := redis.ParseURL(u)
		require.NoError(t, err, "REDIS_URL")
		return opt
	}
	return &redis.Options{Addr: u}
}

// lfRedis returns a client on the test Redis and a key prefix of the test's
// own; the test fails when Redis is unreachable, and its keys are deleted
// when it ends. Never FLUSHALL/FLUSHDB: other tests share the server.
func lfRedis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opt := lfRedisOptions(t)
	client := redis.NewClient(opt)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		t.Fatalf("Redis at %s unreachable: %v (start it: bash scripts/services.sh)", opt.Addr, err)
	}
	prefix := testenv.UniqueName("t") + ":"
	t.Cleanup(func() {
		lfDeleteRedisPrefix(t, client, prefix)
		_ = client.Close()
	})
	return client, prefix
}

// lfDeleteRedisPrefix deletes every key starting with prefix (the test's own).
func lfDeleteRedisPrefix(t testing.TB, client *redis.Client, prefix string) int {
	t.Helper()
	ctx := context.Background()
	deleted := 0
	iter := client.Scan(ctx, 0, prefix+"*", 500).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	require.NoError(t, iter.Err())
	for len(keys) > 0 {
		n := min(len(keys), 500)
		require.NoError(t, client.Del(ctx, keys[:n]...).Err())
		deleted += n
		keys = keys[n:]
	}
	return deleted
}
