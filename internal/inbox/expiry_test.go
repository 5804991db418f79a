package inbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

func TestMarkStaleRecordsStaleAndCommitsClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *inbox.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		require.True(t, inbox.MarkStale(msg.Context()))
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 1, rec.Count(inbox.OutcomeStale))
	require.Equal(t, 0, rec.Count(inbox.OutcomeProcessed))
	require.Equal(t, 1, e.processed(E1))
	require.False(t, inbox.MarkStale(context.Background()))
}

func TestMarkObsoleteAndConsumerFromContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *inbox.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		name, ok := inbox.ConsumerFromContext(msg.Context())
		require.True(t, ok)
		require.Equal(t, "stock", name)
		require.True(t, inbox.MarkObsolete(msg.Context()))
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 1, rec.Count(inbox.OutcomeObsolete))
	require.Equal(t, 1, e.processed(E1))
	_, ok := inbox.ConsumerFromContext(context.Background())
	require.False(t, ok)
	require.False(t, inbox.MarkObsolete(context.Background()))
}
