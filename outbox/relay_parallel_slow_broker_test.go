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
// lasts several leases here (16 rows × 0.75 PublishTimeout); the hiding is
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
		ids := make([]string, 24)
		for i := range ids {
			ids[i] = newID()
		}
		tx, pub := b.begin(t)
		for _, id := range ids {
			require.NoError(t, pub.Publish("events", msg(id)))
		}
		require.NoError(t, tx.Commit())

		const timeout = 200 * time.Millisecond
		s := &slowSink{delay: timeout * 3 / 4}
		// One relay takes long rounds, the other short ones: the short one
		// comes back for more while the long round is still publishing.
		for _, batch := range []int{16, 4} {
			b.relay(t, s, outbox.RelayConfig{BatchSize: batch, Parallel: true, PublishTimeout: timeout})
		}
		eventually(t, 60*time.Second, func() bool { return b.pending(t) == 0 }, "parallel relays drain")
		for _, id := range ids {
			require.Equal(t, 1, s.count(id), "row %s published once", id)
		}
		require.Len(t, s.all(), len(ids))
	})
}
