package redislatest_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// Event ids (valid UUIDv7), idE1 < idE6 in byte order.
const (
	idE1 = "01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b"
	idE6 = "01906dbc-ad05-70f6-9f6a-7b8c9d0e1f2a"
)

// testRedis returns a client on the test Redis (REDIS_URL, redis://… or
// host:port, or 127.0.0.1:6379) and a key prefix of the test's own; the
// test fails when Redis is unreachable, and its keys are deleted when it
// ends. Never FLUSHALL/FLUSHDB: other tests share the server.
func testRedis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opt := &redis.Options{Addr: "127.0.0.1:6379"}
	if u := os.Getenv("REDIS_URL"); strings.Contains(u, "://") {
		var err error
		opt, err = redis.ParseURL(u)
		require.NoError(t, err, "REDIS_URL")
	} else if u != "" {
		opt = &redis.Options{Addr: u}
	}
	client := redis.NewClient(opt)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		t.Fatalf("Redis at %s unreachable: %v (start it: bash scripts/services.sh)", opt.Addr, err)
	}
	prefix := testenv.UniqueName("t") + ":"
	t.Cleanup(func() {
		ctx := context.Background()
		iter := client.Scan(ctx, 0, prefix+"*", 500).Iterator()
		for iter.Next(ctx) {
			_ = client.Del(ctx, iter.Val()).Err()
		}
		_ = client.Close()
	})
	return client, prefix
}
