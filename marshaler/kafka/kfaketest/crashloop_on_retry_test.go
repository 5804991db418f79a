package kfaketest

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

const (
	retryKillChildEnv = "CRASHLOOP_RETRY_CHILD"
	retryKillTopic    = "retrykill"
	retryKillDLQ      = "retrykill.dlq"
)

func init() { memberMain(retryKillChildEnv, func(string) error { return retryKillChild() }) }

// retryKillChild is a member of the group: its handler kills the process
// on the poisoned event's retry (its first attempt in the process failed,
// as on a dependency that is down while the member starts), once the
// member has applied 64 other events (past its start's first 64 attempts).
func retryKillChild() error {
	poison := os.Getenv("CRASHLOOP_POISON")
	var applied atomic.Int64
	var ready atomic.Bool // the poison's last failed attempt ended after 64 others were applied: its next attempt is past the warm-up
	return runCrashMember(crashMemberSpec{
		topic: retryKillTopic, dlqTopic: retryKillDLQ, consumers: []string{"retrykill"},
		retry:  middleware.RetryConfig{MaxRetries: 100000, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond},
		logger: watermill.NewStdLoggerWithOut(os.Stderr, false, false),
		handle: func(_ string, _ *pgxpool.Pool) message.NoPublishHandlerFunc {
			return func(msg *message.Message) error {
				if msg.UUID == poison {
					if !ready.Load() {
						ready.Store(applied.Load() >= 64)
						return errors.New("retrykill child: the dependency is down")
					}
					fmt.Fprintln(os.Stderr, "retrykill child: poisoned event on a retry, SIGKILL")
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {}
				}
				tx, _ := middleware.PgxTxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
					return err
				}
				applied.Add(1)
				return nil
			}
		},
	})
}

// A record whose first attempt in a member fails and whose chain retry
// kills the member, after the member's first 64 attempts, on a topic of 16
// partitions under a steady producer (the scenario of
// TestCrashLoopOnKafkaDeadLettersOnlyThePoisonUnderLoadOnManyPartitions):
// its retry is the same offset given back after an attempt of it ended in
// the member, and it is counted as its first attempt was (the first record
// of its partition after each start), so the record is dead-lettered after
// MaxCrashes deaths and the other events are applied once. When a retry
// "followed" the ended attempt, past the first 64 attempts no death was
// counted and the record killed members for ever.
func TestKafkaRecordKillingMembersOnItsRetryIsDeadLetteredAfterMaxCrashes(t *testing.T) {
	runKafkaCrashLoop(t, kafkaCrashLoop{
		partitions: 16, perChild: 200, childEnv: retryKillChildEnv, topic: retryKillTopic, dlq: retryKillDLQ,
		allowed: middleware.DefaultMaxCrashes, // the first record of its partition: counted in every member
	})
}
