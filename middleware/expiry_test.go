package middleware_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

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
