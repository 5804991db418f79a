package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

var errRefusedForGood = errors.New("refused for good")

// TestRedriveTopicFilterIsExactOnEveryDatabase: RedriveFilter.Topics
// keeps only rows for one of these destination topics, and topics are
// routing keys: "orders", "Orders" and "orders " are three. On MariaDB the
// filter compared the column with its collation (case-insensitive,
// trailing spaces ignored), so a redrive of "orders" also moved the rows
// of the two others; it compares bytes now, as the relay's hold-back does.
func TestRedriveTopicFilterIsExactOnEveryDatabase(t *testing.T) {
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		b := newBox(t, tg)
		wanted, other, spaced := newID(), newID(), newID()
		b.write(t, "orders", wanted)
		b.write(t, "Orders", other)
		b.write(t, "orders ", spaced)

		// All three are dead-lettered (a permanent refusal).
		s := &sink{}
		s.setRefuse(func(topic string, _ *message.Message) error {
			if topic == outbox.DefaultProbeTopic {
				return nil
			}
			return errRefusedForGood
		})
		r, err := b.ob.NewRelay(s, outbox.RelayConfig{PollInterval: 5 * time.Millisecond,
			Permanent: func(err error) bool { return errors.Is(err, errRefusedForGood) }})
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- r.Run(context.Background()) }()
		eventually(t, 20*time.Second, func() bool {
			n, err := b.ob.DeadLetters(context.Background())
			return err == nil && n == 3
		}, "three rows dead-lettered")
		require.NoError(t, r.Close())
		require.NoError(t, <-done)

		n, err := b.ob.Redrive(context.Background(), outbox.RedriveFilter{Topics: []string{"orders"}, DryRun: true})
		require.NoError(t, err)
		require.Equal(t, 1, n, "a dry run of a redrive of topic \"orders\" counts only that topic's dead row")
		n, err = b.ob.Redrive(context.Background(), outbox.RedriveFilter{Topics: []string{"orders"}})
		require.NoError(t, err)
		dead, err := b.ob.DeadLetters(context.Background())
		require.NoError(t, err)
		require.Equal(t, 1, n, "a redrive of topic \"orders\" moves only that topic's dead row")
		require.Equal(t, 2, dead, "the dead rows of \"Orders\" and \"orders \" stay dead-lettered")
	})
}

// TestReplayTopicFilterIsExactOnEveryDatabase: the same for Replay.
func TestReplayTopicFilterIsExactOnEveryDatabase(t *testing.T) {
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		b := newBox(t, tg)
		from := time.Now().Add(-time.Minute)
		wanted, other := newID(), newID()
		b.write(t, "orders", wanted)
		b.write(t, "Orders", other)
		s := &sink{}
		b.relay(t, s, outbox.RelayConfig{Retention: time.Hour})
		eventually(t, 20*time.Second, func() bool { return len(s.all()) == 2 }, "both relayed")

		again := &sink{}
		n, err := b.ob.Replay(context.Background(), b.db, again, outbox.ReplayFilter{
			From: from, To: time.Now().Add(time.Minute), Topics: []string{"orders"}})
		require.NoError(t, err)
		var topics []string
		for _, m := range again.all() {
			topics = append(topics, m.topic)
		}
		require.Equal(t, 1, n, "a replay of topic \"orders\" publishes only that topic's rows; published to %q", topics)
	})
}
