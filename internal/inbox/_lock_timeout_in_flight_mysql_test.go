package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// Two deliveries of one event at once on MariaDB through database/sql:
// the second waits for the first's claim at most its LockTimeout (not the
// server's innodb_lock_wait_timeout, 50 s by default), then fails
// transiently (1205, an ErrInfrastructure: held and retried, never
// poisoned); the first applies the event once.
func TestLockTimeoutBoundsAConcurrentDeliveryOnMariaDB(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetMariaDB, 4)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, tg.DB))
	tg.Exec(t, `CREATE TABLE effect (event_id VARCHAR(36) NOT NULL)`)
	newM := func(d time.Duration) *inbox.Idempotent {
		m, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "inflight", LockTimeout: d, Classifier: mysqlerr.Classify,
		}, nil)
		require.NoError(t, err)
		return m
	}
	release, holding := make(chan struct{}), make(chan struct{})
	slow := newM(0).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		close(holding)
		<-release
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?)`, msg.UUID)
		return nil, err
	})
	fast := newM(time.Second).Middleware(func(msg *message.Message) ([]*message.Message, error) {
		t.Error("handler must not run while the claim is held elsewhere")
		return nil, nil
	})
	id := uuid.Must(uuid.NewV7()).String()
	done := make(chan error, 1)
	go func() { _, err := slow(newMsg(id)); done <- err }()
	<-holding
	fctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	msg := newMsg(id)
	msg.SetContext(fctx)
	_, err = fast(msg)
	close(release)
	require.False(t, errors.Is(fctx.Err(), context.DeadlineExceeded), "the second delivery waited until the failsafe: the lock timeout is not in force (%v)", err)
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err), "%v", err)
	require.ErrorIs(t, err, inbox.ErrInfrastructure, "ConsumerConfig.LockTimeout: MySQL's 1205 on the claim is an ErrInfrastructure")
	require.False(t, inbox.IsPermanent(err))
	require.NoError(t, <-done)
	var n int
	require.NoError(t, tg.Std.QueryRow(`SELECT count(*) FROM effect WHERE event_id = ?`, id).Scan(&n))
	require.Equal(t, 1, n)
}
