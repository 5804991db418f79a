package outbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

func TestRedriveFilterValidate(t *testing.T) {
	t.Parallel()
	require.Error(t, outbox.RedriveFilter{}.Validate(), "an empty filter moves nothing by mistake")
	require.Error(t, outbox.RedriveFilter{EventIDs: []string{""}}.Validate())
	require.Error(t, outbox.RedriveFilter{Topics: []string{""}}.Validate())
	require.NoError(t, outbox.RedriveFilter{All: true}.Validate())
	require.NoError(t, outbox.RedriveFilter{Topics: []string{"a"}}.Validate())
}

// Dead-lettered rows go back to pending with Redrive, selected by event id
// or topic (a dry run counts them), attempts reset, and are then published
// with their event ids; the rows not selected stay dead. On every database.
func TestRedrive(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		b := newBox(t, tg)
		ctx := context.Background()
		a1, a2, c1 := newID(), newID(), newID()
		b.write(t, "a", a1, a2)
		b.write(t, "c", c1)
		var refusing atomic.Bool
		refusing.Store(true)
		s := &sink{refuse: func(topic string, _ *message.Message) error {
			if refusing.Load() && topic != outbox.DefaultProbeTopic {
				return errRefused
			}
			return nil
		}}
		rec := &counts{}
		cfg := outbox.RelayConfig{Recorder: rec, Permanent: func(err error) bool { return errors.Is(err, errRefused) }}
		r := b.relay(t, s, cfg)
		eventually(t, 30*time.Second, func() bool { return rec.dead.Load() == 3 }, "all three dead-lettered")
		require.Zero(t, b.pending(t))
		require.NoError(t, r.Close())
		refusing.Store(false) // the cause is fixed

		n, err := b.ob.Redrive(ctx, outbox.RedriveFilter{Topics: []string{"a"}, DryRun: true})
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.Equal(t, 3, b.count(t, b.table+"_dead"), "a dry run moves nothing")

		n, err = b.ob.Redrive(ctx, outbox.RedriveFilter{Topics: []string{"a"}, EventIDs: []string{a2}})
		require.NoError(t, err)
		require.Equal(t, 1, n)
		var id string
		var attempts int
		var nextTry int64
		require.NoError(t, tg.DB.QueryRow(ctx, `SELECT event_id, attempts, next_try_us FROM `+tg.Quote(b.table)).Scan(&id, &attempts, &nextTry))
		require.Equal(t, a2, id)
		require.Zero(t, attempts, "attempts reset")
		require.Zero(t, nextTry, "due at once")
		b.relay(t, s, cfg)
		eventually(t, 30*time.Second, func() bool { return s.count(a2) == 1 && b.pending(t) == 0 }, "the redriven row is published")
		require.Equal(t, 2, b.count(t, b.table+"_dead"), "the others stay dead")

		n, err = b.ob.Redrive(ctx, outbox.RedriveFilter{All: true})
		require.NoError(t, err)
		require.Equal(t, 2, n)
		eventually(t, 30*time.Second, func() bool { return s.count(a1) == 1 && s.count(c1) == 1 && b.pending(t) == 0 }, "all published")
		require.Zero(t, b.count(t, b.table+"_dead"))
		require.EqualValues(t, 3, rec.dead.Load(), "published at their first attempt after the redrive")
	})
}
