package kfaketest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// The crash loop as it happens in production: the poisoned record reaches a
// member right after it applied the records before it in its partition (70
// here, past its first 64 attempts), not only duplicates as in
// TestCrashLoopOnKafkaBoundedWhenThePoisonReachesAWarmConsumer. That
// member does not count its first crash, so at most MaxCrashes+1 members
// die (docs/transports.md: "MaxCrashes+2 when it first reached a member
// past its first 64 attempts right after the record before it").
func TestCrashLoopOnKafkaBoundedWhenThePoisonFollowsNewEvents(t *testing.T) {
	// The first member, past its first 64 attempts, handled the record
	// before the poisoned one: its crash is not counted.
	runKafkaCrashLoop(t, kafkaCrashLoop{partitions: 1, before: 70, allowed: middleware.DefaultMaxCrashes + 1})
}

// The same under a steady producer on a topic with many partitions (256,
// one member owning all of them): each restarted member receives the first
// uncommitted record of every partition at once, and the poisoned one,
// the first record of its partition, is behind the records of up to 255
// others. It is counted all the same (its partition's first record after a
// start), while the records in flight beside it when it kills the member
// are not counted with it (counted attempts run one at a time) although
// they are the first ones again after each restart. guarantees.md: the
// broker's count is not taken as the crash count because that
// "dead-letters those innocent neighbours"; transports.md (Kafka): "Each
// event is applied once, the poison dead-lettered once". Each child gets
// 512 new records published before it starts. A count of a start's first
// 64 attempts let the poisoned record kill 5 members here.
func TestCrashLoopOnKafkaDeadLettersOnlyThePoisonUnderLoadOnManyPartitions(t *testing.T) {
	runKafkaCrashLoop(t, kafkaCrashLoop{partitions: 256, perChild: 512, allowed: middleware.DefaultMaxCrashes})
}

// kafkaCrashLoop is a crash loop run by runKafkaCrashLoop: a topic of
// partitions partitions; before records, then the poisoned one, then 3
// more, published before the first member starts, and perChild more before
// each member; a member is the test binary started with childEnv=1 (the
// crashlooptest child consuming crashLoopTopic by default); at most allowed
// members may die before the dead letter.
type kafkaCrashLoop struct {
	partitions       int32
	before, perChild int
	allowed          int
	childEnv         string // default "CRASHLOOP_CHILD"
	topic, dlq       string // default crashLoopTopic, crashLoopDLQ
}

// runKafkaCrashLoop starts members one after the other, each killed by the
// poisoned record (SIGKILL in its handler), until every record is applied
// or dead-lettered; then exactly the poisoned one must be dead-lettered,
// after at most cl.allowed deaths.
func runKafkaCrashLoop(t *testing.T, cl kafkaCrashLoop) {
	if cl.childEnv == "" {
		cl.childEnv = "CRASHLOOP_CHILD"
	}
	if cl.topic == "" {
		cl.topic, cl.dlq = crashLoopTopic, crashLoopDLQ
	}
	r := newCrashRig(t, cl.partitions, cl.topic, cl.dlq, `CREATE TABLE effect (event_id text NOT NULL)`)
	r.publish(cl.before)
	poison := r.publish(1)[0]
	r.publish(3)

	var dead []string
	collect := func() {
		for _, m := range r.deadLetters() {
			dead = append(dead, m.UUID)
		}
	}
	crashes := 0
	for finished := false; !finished; {
		if crashes > cl.allowed+2 {
			t.Fatalf("the poisoned record killed %d members (%d allowed) and was not dead-lettered; crash counts %v", crashes, cl.allowed, r.crashCounts(poison))
		}
		if cl.perChild > 0 {
			r.publish(cl.perChild) // the producers do not stop while members crash
		}
		m := r.start(cl.childEnv+"=1", "CRASHLOOP_POISON="+poison)
		deadline := time.Now().Add(2 * time.Minute) // a hang guard, not a measurement
	wait:
		for {
			select {
			case <-m.exited:
				m.requireKilled(t)
				crashes++
				break wait
			case <-time.After(200 * time.Millisecond):
				collect()
				applied := r.count(`SELECT count(DISTINCT event_id) FROM effect`)
				// Done when every record is accounted for: applied or
				// dead-lettered (the assertions below say which).
				if len(dead) > 0 && applied+len(dead) >= len(r.msgs) {
					m.stop()
					finished = true
					break wait
				}
				if time.Now().After(deadline) {
					m.stop()
					t.Fatalf("child %d neither crashed nor finished (%d applied); output:\n%s", crashes+1, applied, m.out.String())
				}
			}
		}
	}
	collect()
	t.Logf("%d crashes, %d dead letters", crashes, len(dead))
	require.Equal(t, []string{poison}, dead, "only the poisoned record is dead-lettered; the others, which killed nothing, are applied")
	require.LessOrEqual(t, crashes, cl.allowed, "members killed by the poisoned record before its dead letter (%d allowed)", cl.allowed)
}
