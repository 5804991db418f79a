package middleware_test

import (
	"context"
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// uuidV7At returns a UUIDv7 whose timestamp is at (RFC 9562 §5.7).
func uuidV7At(at time.Time) uuid.UUID {
	id := uuid.Must(uuid.NewV7())
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(at.UnixMilli()))
	copy(id[0:6], ms[2:8])
	return id
}

// An old event redelivered after its processed row was purged is refused as
// expired (permanent), never re-applied.
func TestExpiredEventAfterPurgeIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	now := time.Now()
	clock := now.Add(-47 * time.Hour) // the first delivery happened 47 h ago
	var calls atomic.Int32
	h := e.mw(e.pool, func(c *middleware.Config) {
		c.ReplayHorizon = 24 * time.Hour
		c.Now = func() time.Time { return clock }
	})(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, writeEffect(msg, "x")
	})
	id := uuidV7At(now.Add(-48 * time.Hour))
	_, err := h(newMsg(id.String()))
	require.NoError(t, err)
	require.EqualValues(t, 1, calls.Load())

	// 47 hours later the purger (horizon 24 h) removed the row.
	_, err = e.pool.Exec(ctx, `UPDATE processed_event SET processed_at = now() - interval '47 hours'`)
	require.NoError(t, err)
	p, err := processed.NewPurger(e.store, sqldb.PgxPool(e.pool), processed.PurgerConfig{Horizon: 24 * time.Hour}, nil)
	require.NoError(t, err)
	n, _, err := p.PurgeNow(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	clock = now
	_, err = h(newMsg(id.String())) // the redelivery
	require.ErrorIs(t, err, middleware.ErrExpired)
	require.True(t, middleware.IsPermanent(err))
	require.EqualValues(t, 1, calls.Load(), "never re-applied")
	require.Equal(t, 1, e.effects(id.String()))
}

// Without a UUIDv7 the age comes from occurred_at.
func TestExpiryFallsBackToOccurredAt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := e.mw(e.pool, func(c *middleware.Config) { c.ReplayHorizon = time.Hour })(func(msg *message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	old := newMsg(uuid.NewString()) // v4: no time inside
	old.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().Add(-2*time.Hour).UTC().Format(time.RFC3339Nano))
	_, err := h(old)
	require.ErrorIs(t, err, middleware.ErrExpired)
	fresh := newMsg(uuid.NewString())
	fresh.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano))
	_, err = h(fresh)
	require.NoError(t, err)
	_, err = h(newMsg(uuidV7At(time.Now().Add(-2 * time.Hour)).String()))
	require.ErrorIs(t, err, middleware.ErrExpired)
}

func TestMarkStaleRecordsStaleAndCommitsClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *middleware.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		require.True(t, middleware.MarkStale(msg.Context()))
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 1, rec.Count(middleware.OutcomeStale))
	require.Equal(t, 0, rec.Count(middleware.OutcomeProcessed))
	require.Equal(t, 1, e.processed(E1))
	require.False(t, middleware.MarkStale(context.Background()))
}

func TestMarkObsoleteAndConsumerFromContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *middleware.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		name, ok := middleware.ConsumerFromContext(msg.Context())
		require.True(t, ok)
		require.Equal(t, "stock", name)
		require.True(t, middleware.MarkObsolete(msg.Context()))
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 1, rec.Count(middleware.OutcomeObsolete))
	require.Equal(t, 1, e.processed(E1))
	_, ok := middleware.ConsumerFromContext(context.Background())
	require.False(t, ok)
	require.False(t, middleware.MarkObsolete(context.Background()))
}
