package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// RedriveFilter.EventIDs "keeps only rows with one of these event ids".
// The outbox stores event ids canonical: a producer that redrives its
// dead-lettered event by the id it published (msg.UUID, an accepted
// upper-case form) must still find it (Redrive matches each id as given
// and canonical).
func TestRedriveByTheProducersEventIDFindsItsDeadRow(t *testing.T) {
	t.Parallel()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 4)
	b := newBox(t, tg)
	ctx := context.Background()
	id := strings.ToUpper(newID())
	b.write(t, "a", id)
	var refusing atomic.Bool
	refusing.Store(true)
	s := &sink{refuse: func(topic string, _ *message.Message) error {
		if refusing.Load() && topic != outbox.DefaultProbeTopic {
			return errRefused
		}
		return nil
	}}
	rec := &counts{}
	r := b.relay(t, s, outbox.RelayConfig{Recorder: rec, Permanent: func(err error) bool { return errors.Is(err, errRefused) }})
	eventually(t, 30*time.Second, func() bool { return rec.dead.Load() == 1 }, "dead-lettered")
	require.NoError(t, r.Close())
	n, err := b.ob.Redrive(ctx, outbox.RedriveFilter{EventIDs: []string{id}, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 1, n, "the producer's event id %s (msg.UUID as published) selects no dead row", id)
}
