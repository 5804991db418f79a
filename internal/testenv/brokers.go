package testenv

import (
	"os"
	"strings"
)

// DefaultNATSURL is used when NATS_URL is unset: the shared NATS server with
// JetStream enabled.
const DefaultNATSURL = "nats://127.0.0.1:4222"

// DefaultRedisAddr is used when REDIS_URL is unset.
const DefaultRedisAddr = "127.0.0.1:6379"

// NATSURL is NATS_URL or DefaultNATSURL.
func NATSURL() string {
	if u := os.Getenv("NATS_URL"); u != "" {
		return u
	}
	return DefaultNATSURL
}

// RedisAddr is the host:port of REDIS_URL (redis://host:port/… or host:port)
// or DefaultRedisAddr.
func RedisAddr() string {
	u := os.Getenv("REDIS_URL")
	if u == "" {
		return DefaultRedisAddr
	}
	if _, rest, ok := strings.Cut(u, "://"); ok {
		u = rest
	}
	if i := strings.LastIndex(u, "@"); i >= 0 {
		u = u[i+1:]
	}
	if i := strings.Index(u, "/"); i >= 0 {
		u = u[:i]
	}
	return u
}
