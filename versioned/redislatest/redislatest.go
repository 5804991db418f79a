// Package redislatest is the Redis versioned.LatestStore, in a module of its
// own so that the core module links no Redis client.
package redislatest

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Redis store defaults (Config).
const (
	// DefaultPrefix starts every key of a Store.
	DefaultPrefix = "idempotency:family-latest:"
	// DefaultTTL is how long a family's record lives after its last
	// Advance: long enough to cover a consumer's night-long backlog, the
	// moment the filter saves the most. About 100 bytes per family: a
	// million active families cost on the order of 100 MB.
	DefaultTTL = 24 * time.Hour
)

// Config configures a Store.
type Config struct {
	// Client is the Redis client (*redis.Client, *redis.ClusterClient,
	// *redis.Ring…). Required. Each operation touches one key, so a cluster
	// works.
	Client redis.UniversalClient

	// Prefix starts every key; the rest is "<len(kind)>:<kind>:<id>", which
	// no two families share. Defaults to DefaultPrefix.
	Prefix string

	// TTL is set (PX, milliseconds) on a family's key at every Advance,
	// whether or not the record moved. It must exceed the longest time a
	// message of the family may wait in a queue for the filter to stay
	// effective; when a key expires earlier, messages are let through, never
	// dropped. Defaults to DefaultTTL; at least one millisecond.
	TTL time.Duration
}

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
}

// Validate reports the first invalid field of c, naming it.
func (c Config) Validate() error {
	switch {
	case c.Client == nil:
		return errors.New("redislatest: Config.Client is required")
	case c.TTL != 0 && c.TTL < time.Millisecond:
		return fmt.Errorf("redislatest: Config.TTL %s: must be ≥ 1ms", c.TTL)
	}
	return nil
}

// Store is the Redis LatestStore: one string key per family holding
// the hex of versioned.Position.MarshalBinary, advanced by a Lua script that compares
// and sets atomically (Redis runs a script alone), with a TTL. It is not
// Transactional: its writes do not roll back with a database transaction,
// which is why LatestPublisher records only once the message is out (see
// versioned.LatestPublisherConfig.Deferred) and the versioned.LatestFilter lets a message through
// when Redis fails.
//
// What Redis may lose, and what it costs: a key that expires, is evicted, or
// vanishes with a restart or a FLUSH only makes the filter let the family's
// older messages through to the handler (more work, as without the filter);
// the applied table of the versioned.FamilyStore, written in the handler's database
// transaction, still drops any message not newer than one already applied.
// A lost key never causes the latest message to be dropped: Advance never
// moves a key backwards, and a key only ever names a message that was
// published.
type Store struct {
	client redis.UniversalClient
	prefix string
	ttlMS  string
}

var _ versioned.LatestStore = (*Store)(nil)

// New validates cfg (on a copy with defaults applied). It does not
// contact Redis.
func New(cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	return &Store{
		client: cfg.Client,
		prefix: cfg.Prefix,
		ttlMS:  strconv.FormatInt(cfg.TTL.Milliseconds(), 10),
	}, nil
}

// Key returns the Redis key of f's record.
func (r *Store) Key(f versioned.Family) string {
	return r.prefix + strconv.Itoa(len(f.Kind)) + ":" + f.Kind + ":" + f.ID
}

// Transactional reports false: see Store.
func (r *Store) Transactional() bool { return false }

// redisAdvance is the compare-and-set. KEYS[1] is the family's key, ARGV[1]
// the new position (hex of MarshalBinary), ARGV[2] the TTL in milliseconds.
// It returns 1 when the key was set, 0 when the stored position is equal or
// newer (the TTL is refreshed either way: the family is active). Positions
// are compared byte by byte, not with Lua's < on strings, which goes through
// the C library's strcoll and so depends on the server's locale.
var redisAdvance = redis.NewScript(`
local function newer(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x > y end
  end
  return #a > #b
end
local cur = redis.call('GET', KEYS[1])
if cur and not newer(ARGV[1], cur) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
`)

// Advance sets f's key to pos when pos is newer than the stored position or
// no key exists, in one script run (EVALSHA, falling back to EVAL), and
// refreshes the TTL. q is ignored. Errors: versioned.ErrFamilyInvalid (wrapped) for an
// invalid f or a nil event id; Redis errors wrapped with %w.
func (r *Store) Advance(ctx context.Context, _ sqldb.Querier, f versioned.Family, pos versioned.Position) (bool, error) {
	if err := f.Validate(); err != nil {
		return false, err
	}
	if pos.EventID == uuid.Nil {
		return false, fmt.Errorf("%w: nil event id", versioned.ErrFamilyInvalid)
	}
	b, err := pos.MarshalBinary()
	if err != nil {
		return false, err
	}
	n, err := redisAdvance.Run(ctx, r.client, []string{r.Key(f)}, hex.EncodeToString(b), r.ttlMS).Int64()
	if err != nil {
		return false, fmt.Errorf("redislatest: redis advance latest of %s: %w", f, err)
	}
	return n == 1, nil
}

// Latest returns f's recorded position; ok is false when the key does not
// exist. q is ignored. A value that does not decode is an error (the
// filter then lets the message through).
func (r *Store) Latest(ctx context.Context, _ sqldb.Querier, f versioned.Family) (versioned.Position, bool, error) {
	s, err := r.client.Get(ctx, r.Key(f)).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return versioned.Position{}, false, nil
	case err != nil:
		return versioned.Position{}, false, fmt.Errorf("redislatest: redis latest of %s: %w", f, err)
	}
	b, err := hex.DecodeString(s)
	var p versioned.Position
	if err == nil {
		err = p.UnmarshalBinary(b)
	}
	if err != nil {
		return versioned.Position{}, false, fmt.Errorf("redislatest: redis latest of %s: value %q: %w", f, s, err)
	}
	return p, true, nil
}
