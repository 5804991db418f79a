package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// hrevFailsafe only ends a test that would otherwise hang; it is never the
// subject of an assertion about speed.
const hrevFailsafe = 20 * time.Second

// Config.LockTimeout is "PostgreSQL's lock_timeout for the whole attempt's
// transaction". The claim's own lock on the claim table (RowExclusiveLock,
// taken by the executor before any expression of the statement, so before
// a set_config in its WHERE) must be bounded too: while another session
// holds the table (LOCK TABLE, ALTER TABLE, a partition DROP of the
// purger, a layout switch), an attempt fails with ErrInFlight after
// LockTimeout instead of waiting for as long as the other session holds
// it. The connection is warmed first, so the claim is already prepared.
func TestHREV_LockTimeoutBoundsTheClaimTableLock(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var schema string
			_, h := preparedClaimSetupLock(t, mode, 1, 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				return tx.QueryRow(ctx, "SELECT current_schema()").Scan(&schema)
			})
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`)) // prepares the claim
			require.NoError(t, err)

			holder, err := pgx.Connect(ctx, testenv.PostgresURL())
			require.NoError(t, err)
			defer holder.Close(ctx)
			htx, err := holder.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = htx.Rollback(ctx) }()
			_, err = htx.Exec(ctx, "LOCK TABLE "+pgx.Identifier{schema, "processed_event"}.Sanitize()+" IN ACCESS EXCLUSIVE MODE")
			require.NoError(t, err)

			msg := preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`)
			mctx, cancel := context.WithTimeout(ctx, hrevFailsafe)
			defer cancel()
			msg.SetContext(mctx)
			_, err = h(msg)
			require.Error(t, err)
			require.False(t, errors.Is(err, context.DeadlineExceeded), "the claim waited on the table lock until the failsafe: %v", err)
			require.ErrorIs(t, err, middleware.ErrInFlight)
		})
	}
}
