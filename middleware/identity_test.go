package middleware_test

import (
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// msg.UUID is parsed with the marshaler's strict rules (marshaler.ParseEventID):
// uuid.Parse accepts any 38-character string whose first and last characters
// are arbitrary, and such an id is refused before any SQL runs.
func TestEventIDIsParsedStrictly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	for _, id := range []string{"x" + E1 + "y", "(" + E1 + ")", "{" + E1 + ")", " " + E1 + " ", "urn:uuix:" + E1} {
		_, err := h(newMsg(id))
		require.ErrorIs(t, err, middleware.ErrInvalidEventID, id)
		require.True(t, middleware.IsPermanent(err), id)
	}
	require.EqualValues(t, 0, calls.Load())
	require.Equal(t, 0, e.count(`SELECT count(*) FROM processed_event`))
}
