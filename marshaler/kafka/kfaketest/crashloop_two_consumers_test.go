package kfaketest

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

const (
	twoConsChildEnv = "CRASHLOOP_TWOCONS_CHILD"
	twoConsTopic    = "twocons"
	twoConsDLQ      = "twocons.dlq"
)

func init() { memberMain(twoConsChildEnv, func(string) error { return twoConsChild() }) }

// twoConsChild is one service process with two consumers ("stock" and
// "analytics", a consumer group each) of the same topic; the poisoned
// event kills the process in either handler.
func twoConsChild() error {
	poison := os.Getenv("CRASHLOOP_POISON")
	return runCrashMember(crashMemberSpec{
		topic: twoConsTopic, dlqTopic: twoConsDLQ, consumers: []string{"stock", "analytics"},
		logger: watermill.NewStdLoggerWithOut(os.Stderr, false, false),
		handle: func(name string, _ *pgxpool.Pool) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				if msg.UUID == poison {
					fmt.Fprintln(os.Stderr, "twocons child: poisoned event in", name, ", SIGKILL")
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				}
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), `INSERT INTO effect (consumer, event_id) VALUES ($1, $2)`, name, msg.UUID)
				return err
			}
		},
	})
}

// One service process with two consumers of one topic (a consumer group
// each, as transports.md asks: "per consumer a group per bound topic"),
// and a record that kills the process in either handler. The crash bound
// is per consumer: counted attempts run one at a time in the process,
// whatever the consumer, so each death is counted for the one consumer
// whose attempt was running, never for the other one, which waited (its
// handler might have taken the record well). Each consumer dead-letters
// the record after MaxCrashes deaths in its own attempts: the process dies
// at most 2×MaxCrashes times (docs/guarantees.md), and every other record
// is applied once by each consumer. A death between one consumer's dead
// letter and its ack (the other consumer's attempt, running as soon as
// the first one's ended) dead-letters the record again for that consumer:
// another copy, as docs/guarantees.md and transports.md (a crash before
// the offset commit) say.
func TestKafkaRecordKillingAProcessWithTwoConsumersIsDeadLetteredByEachAfterItsOwnDeaths(t *testing.T) {
	r := newCrashRig(t, 1, twoConsTopic, twoConsDLQ, `CREATE TABLE effect (consumer text NOT NULL, event_id text NOT NULL)`)
	poison := r.publish(4)[0]

	var dead, deadFrom []string
	collect := func() {
		for _, m := range r.deadLetters() {
			reason := m.Metadata.Get("reason_poisoned")
			dead = append(dead, m.UUID)
			deadFrom = append(deadFrom, reason[:min(60, len(reason))]+" by "+m.Metadata.Get("handler_poisoned"))
		}
	}
	deaths := 0
	for finished := false; !finished; {
		if deaths > 2*middleware.DefaultMaxCrashes+1 {
			t.Fatalf("%d deaths and not finished", deaths)
		}
		m := r.start(twoConsChildEnv+"=1", "CRASHLOOP_POISON="+poison)
		deadline := time.Now().Add(2 * time.Minute) // a hang guard, not a measurement
	wait:
		for {
			select {
			case <-m.exited:
				m.requireKilled(t)
				deaths++
				break wait
			case <-time.After(200 * time.Millisecond):
				collect()
				// Done: each consumer dead-lettered the poison and applied the 3 others.
				if len(dead) >= 2 && r.count(`SELECT count(*) FROM effect`) >= 6 {
					m.stop()
					finished = true
					break wait
				}
				if time.Now().After(deadline) {
					m.stop()
					t.Fatalf("child neither crashed nor finished; output:\n%s", m.out.String())
				}
			}
		}
	}
	collect()
	t.Logf("%d process deaths, %d dead letters: %q", deaths, len(dead), deadFrom)
	for _, id := range dead {
		require.Equal(t, poison, id, "only the poison is dead-lettered: %q", deadFrom)
	}
	require.GreaterOrEqual(t, len(dead), 2, "each consumer dead-letters the poison")
	require.Equal(t, 6, r.count(`SELECT count(*) FROM effect`), "each other record applied once per consumer")
	require.LessOrEqual(t, deaths, 2*middleware.DefaultMaxCrashes,
		"the process was killed %d times by one record (MaxCrashes %d for each of 2 consumers)", deaths, middleware.DefaultMaxCrashes)
}
