package inbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// ConsumerConfig.LockTimeout on SQLite: busy_timeout is the only bound, and
// when a delivery's attempt meets the write lock another delivery of the
// same event holds past it, the attempt fails with SQLITE_BUSY, an
// ErrInfrastructure (transient: held and retried, never permanent); once
// the first commits, the retry skips as a duplicate and the effect is
// applied once.
func TestBusyTimeoutOnSQLiteFailsAConcurrentDeliveryTransiently(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, tg.DB))
	tg.Exec(t, `CREATE TABLE effect (event_id TEXT NOT NULL)`)
	// A second handle on the same file (another instance) waits 200 ms
	// for the write lock instead of the recommended 10 s.
	other, err := sql.Open("sqlite", strings.Replace(testenv.SQLiteDSN(tg.Database), "busy_timeout(10000)", "busy_timeout(200)", 1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close() })
	newM := func(db *sql.DB, h message.HandlerFunc) message.HandlerFunc {
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: mustBeginner(inbox.NewStdBeginner(db)), Store: store, Consumer: "busy"}, nil)
		require.NoError(t, err)
		return m.Middleware(h)
	}
	release, holding := make(chan struct{}), make(chan struct{})
	calls := 0
	slow := newM(tg.Std, func(msg *message.Message) ([]*message.Message, error) {
		calls++
		close(holding)
		<-release
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?)`, msg.UUID)
		return nil, err
	})
	fast := newM(other, func(msg *message.Message) ([]*message.Message, error) {
		calls++
		return nil, nil
	})
	id := uuid.Must(uuid.NewV7()).String()
	done := make(chan error, 1)
	go func() { _, err := slow(newMsg(id)); done <- err }()
	<-holding
	_, err = fast(newMsg(id))
	close(release)
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err), "%v", err)
	require.ErrorIs(t, err, inbox.ErrInfrastructure, "ConsumerConfig.LockTimeout: SQLITE_BUSY on the claim is an ErrInfrastructure")
	require.False(t, inbox.IsPermanent(err))
	require.NoError(t, <-done)
	_, err = fast(newMsg(id)) // the retry, after the first committed
	require.NoError(t, err)
	require.Equal(t, 1, calls, "the handler ran for the duplicate")
	var n int
	require.NoError(t, tg.Std.QueryRow(`SELECT count(*) FROM effect WHERE event_id = ?`, id).Scan(&n))
	require.Equal(t, 1, n)
}
