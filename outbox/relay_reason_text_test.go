package outbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// longMultibyteError is a publish error whose text is longer than the
// relay's stored-reason bound (4000 bytes) with a two-byte character
// straddling that bound: a broker or marshaler error that quotes the
// message's content (a schema validation failure, say) in a non-ASCII
// language.
type longMultibyteError struct{ unroutable bool }

func (e longMultibyteError) Error() string {
	return strings.Repeat("x", 3999) + strings.Repeat("é", 50)
}

func (e longMultibyteError) Unroutable() bool { return e.unroutable }

// A row whose publish error has a long non-ASCII text is set aside
// (dead-lettered when permanent, delayed when unroutable) like any other,
// and the rows the broker took in its round are removed once: the stored
// reason stays valid text for the database.
func TestRelayRowWithLongNonASCIIErrorIsSetAsideAndItsRoundSettled(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		for _, unroutable := range []bool{false, true} {
			name := "Permanent"
			if unroutable {
				name = "Unroutable"
			}
			t.Run(name, func(t *testing.T) {
				b := newBox(t, tg)
				bad, good := newID(), newID()
				b.write(t, "bad", bad)
				b.write(t, "good", good)
				s := &sink{refuse: func(_ string, m *message.Message) error {
					if m.UUID == bad {
						return longMultibyteError{unroutable: unroutable}
					}
					return nil
				}}
				rec := &counts{}
				b.relay(t, s, outbox.RelayConfig{
					Recorder:      rec,
					RetryInterval: 10 * time.Millisecond,
					MaxBackoff:    50 * time.Millisecond,
					Permanent: func(err error) bool {
						var e longMultibyteError
						return errors.As(err, &e) && !e.unroutable
					},
				})
				eventually(t, 30*time.Second, func() bool { return s.count(good) >= 1 }, "the good row published")
				// Give the relay a few more rounds.
				n := rec.rounds.Load()
				deadline := time.Now().Add(10 * time.Second)
				for rec.rounds.Load() < n+5 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				time.Sleep(300 * time.Millisecond)
				require.Equal(t, 1, s.count(good), "the good row of the round is published once and removed (settle committed); got %d publishes", s.count(good))
				if !unroutable {
					eventually(t, 10*time.Second, func() bool { return rec.dead.Load() == 1 }, "the permanent row is dead-lettered")
					require.Equal(t, 0, b.pending(t))
				} else {
					require.Equal(t, 1, b.pending(t), "the unroutable row waits")
				}
			})
		}
	})
}
