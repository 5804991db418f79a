package outbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// slowSink takes every message, each publish after a delay within the
// relay's PublishTimeout: a slow broker, not a stalled one.
type slowSink struct {
	sink
	delay time.Duration
}

func (s *slowSink) Publish(topic string, msgs ...*message.Message) error {
	time.Sleep(s.delay)
	return s.sink.Publish(topic, msgs...)
}

// Parallel relays hide their claimed rows from each other for a lease (two
// PublishTimeouts). A round of slow publishes, each within PublishTimeout,
// lasts longer than a lease here (16 rows × 0.15 PublishTimeout); the hiding is
// renewed as the round goes, so the other relay never takes a row this one
// is publishing or has published but not yet removed: each row reaches the
// broker once.
func TestParallelRelaysPublishEachRowOnceWithASlowBroker(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		if tg.Dialect == sqldb.SQLite {
			return // Parallel is refused on SQLite (testOrder)
		}
		b := newBox(t, tg)
		ids := make([]string, 40)
		for i := range ids {
			ids[i] = newID()
		}
		tx, pub := b.begin(t)
		for _, id := range ids {
			require.NoError(t, pub.Publish("events", msg(id)))
		}
		require.NoError(t, tx.Commit())

		// Each publish well within PublishTimeout (a slow broker, not a
		// stalled one: the margin absorbs a loaded machine's delays); a
		// long round (16 rows) outlasts the lease.
		const timeout = time.Second
		s := &slowSink{delay: 150 * time.Millisecond}
		// One relay takes long rounds, the other rounds of one row: the
		// short ones come back for more while the long round is still
		// publishing, past its first lease.
		for _, batch := range []int{16, 1} {
			b.relay(t, s, outbox.RelayConfig{BatchSize: batch, Parallel: true, PublishTimeout: timeout})
		}
		eventually(t, 60*time.Second, func() bool { return b.pending(t) == 0 }, "parallel relays drain")
		for _, id := range ids {
			require.Equal(t, 1, s.count(id), "row %s published once", id)
		}
		require.Len(t, s.all(), len(ids))
	})
}
