package inbox_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// A partition that moves between live members while its record 9 fails
// (a dependency down: each member that holds the partition during the
// outage attempts record 9 and fails; the claim inserted and rolled back).
// The last owner applies 9 once the dependency is back; the others' later
// retries of 9 are duplicates. Then the poisoned record 10 reaches each of
// these members in turn (each death gives the partition to the next
// survivor). Only the member that applied 9 may take 10 for the record
// after its own: docs/transports.md's worst case is "MaxCrashes+2 when it
// reached a consumer … right after the record before it (first, or when
// its partition came back to that consumer from one that died on it)", one
// uncounted death. When a failed attempt marked its record as one a member
// had handled, every member that held the partition during the outage
// added one.
func TestKafkaPoisonAfterARecordThatFailedInSeveralMembersIsDeadLetteredWithinTheWorstCaseBound(t *testing.T) {
	for _, members := range []int{2, 3} {
		t.Run(map[int]string{2: "two members", 3: "three members"}[members], func(t *testing.T) {
			poisonAfterSharedFailedRecord(t, members)
		})
	}
}

func poisonAfterSharedFailedRecord(t *testing.T, members int) {
	g := newMemberGroup(t)
	const maxCrashes = 3
	poison := uuid.Must(uuid.NewV7()).String()
	before := uuid.Must(uuid.NewV7()).String()
	dependencyUp := false

	type live struct {
		h        message.HandlerFunc
		handlers map[string]func(*message.Message, int) error
	}
	var group []live
	for i := 0; i < members; i++ {
		handlers := map[string]func(*message.Message, int) error{
			before: func(*message.Message, int) error {
				g.mu.Lock()
				up := dependencyUp
				g.mu.Unlock()
				if !up {
					return errDependencyDown
				}
				return nil
			},
		}
		h := g.member(handlers)
		g.warm(h)
		group = append(group, live{h, handlers})
		// The partition moves to this member (a rebalance while the
		// outage lasts): its attempt of record 9 fails.
		_, err := h(record(before, "orders/0/9"))
		require.ErrorIs(t, err, errDependencyDown, "member %d", i)
	}
	// The dependency is back: the last owner applies record 9; the
	// earlier owners' pending retries of it are duplicates.
	g.mu.Lock()
	dependencyUp = true
	g.mu.Unlock()
	_, err := group[members-1].h(record(before, "orders/0/9"))
	require.NoError(t, err)
	for i := 0; i < members-1; i++ {
		_, err := group[i].h(record(before, "orders/0/9"))
		require.NoError(t, err)
	}
	require.Equal(t, 1, g.e.count(`SELECT count(*) FROM effect WHERE event_id = $1`, before))

	// The poisoned record 10 reaches the live members one after another,
	// the last owner first; then restarted members.
	delivery := 0
	order := []int{members - 1}
	for i := 0; i < members-1; i++ {
		order = append(order, i)
	}
	for _, i := range order {
		delivery++
		counted := make(chan int, 1)
		g.mu.Lock()
		group[i].handlers[poison] = g.dies(counted)
		g.mu.Unlock()
		n, ended, err := g.deliver(func() error { _, err := group[i].h(record(poison, "orders/0/10")); return err }, counted)
		if ended {
			require.ErrorIs(t, err, inbox.ErrCrashLoop, "delivery %d ended, not as a crash loop", delivery)
			return
		}
		t.Logf("delivery %d: live member %d killed; crash count %d", delivery, i, n)
	}
	for delivery < maxCrashes+2 {
		delivery++
		counted := make(chan int, 1)
		h := g.member(map[string]func(*message.Message, int) error{poison: g.dies(counted)})
		g.warm(h)
		n, ended, err := g.deliver(func() error { _, err := h(record(poison, "orders/0/10")); return err }, counted)
		if ended {
			require.ErrorIs(t, err, inbox.ErrCrashLoop, "delivery %d ended, not as a crash loop", delivery)
			t.Logf("dead-lettered at delivery %d", delivery)
			return
		}
		t.Logf("delivery %d: restarted member killed; crash count %d", delivery, n)
	}
	t.Fatalf("the poisoned record killed %d members (MaxCrashes %d, documented worst case: dead-lettered at delivery %d) and is not dead-lettered: its crash count is %d",
		delivery, maxCrashes, maxCrashes+2, g.e.crashCount("stock", poison))
}
