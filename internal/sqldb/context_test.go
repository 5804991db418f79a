package sqldb_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

type otherKey struct{}

// A TxContext is the context ContextWithTx returns: the transaction under
// TxFromContext's key, every other value, the deadline and the
// cancellation of the context it wraps, also for contexts derived from it.
func TestTxContextCarriesTheTransactionAndEverythingOfItsContext(t *testing.T) {
	t.Parallel()
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), otherKey{}, "kept"))
	deadline := time.Now().Add(time.Hour)
	parent, cancelDeadline := context.WithDeadline(parent, deadline)
	defer cancelDeadline()
	q := sqldb.Std(nil)
	ctx := &sqldb.TxContext{Context: parent, Tx: q}

	got, ok := sqldb.TxFromContext(ctx)
	require.True(t, ok)
	require.Equal(t, q, got)
	require.Equal(t, "kept", ctx.Value(otherKey{}))
	d, ok := ctx.Deadline()
	require.True(t, ok)
	require.Equal(t, deadline, d)

	child, stop := context.WithCancel(context.WithValue(ctx, otherKey{}, "child"))
	defer stop()
	got, ok = sqldb.TxFromContext(child)
	require.True(t, ok, "a derived context still carries the transaction")
	require.Equal(t, q, got)
	require.Equal(t, "child", child.Value(otherKey{}))

	cause := context.Canceled
	cancel(cause)
	<-child.Done()
	require.ErrorIs(t, child.Err(), context.Canceled)
	require.ErrorIs(t, ctx.Err(), context.Canceled)

	_, ok = sqldb.TxFromContext(parent)
	require.False(t, ok, "the wrapped context has no transaction")
}
