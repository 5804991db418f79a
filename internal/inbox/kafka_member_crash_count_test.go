package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/internal/wire"
)

// memberGroup simulates the member processes of one Kafka consumer group
// sharing one database: each member is a middleware built afresh on a pool
// of its own (its own warm-up and partition marks). A member "dies" in a
// handler: the attempt's backend is terminated (its transaction rolled
// back, as when the process is gone) and the handler never returns, so
// nothing in the process ends the attempt's crash count.
type memberGroup struct {
	t     *testing.T
	e     *env
	die   chan struct{} // closed at cleanup: the "dead" handlers return
	wg    sync.WaitGroup
	mu    sync.Mutex
	pools []*pgxpool.Pool
	warms int // a fresh offset for the warm-up records of each member
}

var errDependencyDown = errors.New("test: the dependency is down")

func newMemberGroup(t *testing.T) *memberGroup {
	e := newEnv(t)
	g := &memberGroup{t: t, e: e, die: make(chan struct{})}
	// A dead attempt holds its process's counted turn for ever (where it
	// takes it); here every member shares this test process's turn.
	restore := inbox.SetCountedTurnWait(10 * time.Millisecond)
	t.Cleanup(func() {
		close(g.die)
		g.wg.Wait()
		for _, p := range g.pools {
			p.Close()
		}
		restore()
	})
	return g
}

// member is a new member process. handlers (read at each attempt; set them
// before delivering) replace the effect of a message id: given the
// message and its attempt number in this member, an error fails the
// attempt.
func (g *memberGroup) member(handlers map[string]func(msg *message.Message, attempt int) error) message.HandlerFunc {
	pool, err := pgxpool.NewWithConfig(context.Background(), testenv.PoolConfig(g.t, testenv.PostgresURL(), g.e.schema, 4))
	require.NoError(g.t, err)
	g.pools = append(g.pools, pool)
	attempts := map[string]int{}
	return g.e.mw(pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = sqldb.Pgx(pool)
	})(func(msg *message.Message) ([]*message.Message, error) {
		g.mu.Lock()
		attempts[msg.UUID]++
		n := attempts[msg.UUID]
		h := handlers[msg.UUID]
		g.mu.Unlock()
		if h != nil {
			if err := h(msg, n); err != nil {
				return nil, err
			}
		}
		return nil, writeEffect(msg, "")
	})
}

// warm takes the member past its first 64 attempts: 64 new events, each
// the first record of its own partition of another topic.
func (g *memberGroup) warm(h message.HandlerFunc) {
	g.t.Helper()
	g.warms++
	for i := 0; i < 64; i++ {
		_, err := h(record(uuid.Must(uuid.NewV7()).String(), fmt.Sprintf("warm/%d/%d", i, g.warms)))
		require.NoError(g.t, err)
	}
}

// record is a Kafka delivery of event id at position, as marshaler/kafka
// gives it.
func record(id, position string) *message.Message {
	m := newMsg(id)
	m.Metadata.Set(wire.Position, position)
	m.SetContext(context.Background())
	return m
}

// dies kills the member in its handler: it sends the event's crash count
// as the dying attempt left it (its earlier deaths, plus this attempt when
// it is counted), and never returns.
func (g *memberGroup) dies(counted chan<- int) func(msg *message.Message, _ int) error {
	return func(msg *message.Message, _ int) error {
		counted <- g.e.crashCount("stock", msg.UUID)
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, _ = tx.Exec(context.Background(), `SELECT pg_terminate_backend(pg_backend_pid())`)
		<-g.die
		return errors.New("test: dead")
	}
}

// deliver runs a delivery in a goroutine (a dying one never returns) and
// returns the crash count its dying attempt saw, or the delivery's error
// when it ended without a death.
func (g *memberGroup) deliver(run func() error, counted <-chan int) (n int, ended bool, err error) {
	g.t.Helper()
	done := make(chan error, 1)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		done <- run()
	}()
	select {
	case n := <-counted:
		return n, false, nil
	case err := <-done:
		return 0, true, err
	case <-time.After(2 * time.Minute): // a hang guard, not a measurement
		g.t.Fatal("the delivery neither died nor ended")
		return 0, false, nil
	}
}

// A record whose first attempt in a member fails (a dependency down: the
// chain retries it) and whose retry then kills the member is the first
// record of its partition after every start, so its first attempt is
// counted; that attempt ends (failed), and its retry, the same offset given
// back, must be counted too: it is the one that dies. When a record given
// back after an attempt that ended "followed" it, past the start's first 64
// attempts no death was ever counted and the record killed every member for
// ever, where docs/transports.md promises its dead letter at delivery
// MaxCrashes+1. Each member here is a middleware built afresh on a pool of
// its own; a death leaves its attempt unended (memberGroup).
func TestKafkaRecordKillingTheMemberOnItsRetryIsDeadLetteredAsACrashLoop(t *testing.T) {
	retryKillsMembers(t, true)
}

// The control of the test above: the same record met within each start's
// first 64 attempts is dead-lettered after MaxCrashes deaths (the harness
// sees counted deaths).
func TestKafkaRecordKillingTheMemberOnItsRetryWithinTheWarmupIsDeadLetteredAsACrashLoop(t *testing.T) {
	retryKillsMembers(t, false)
}

func retryKillsMembers(t *testing.T, warm bool) {
	g := newMemberGroup(t)
	poison := uuid.Must(uuid.NewV7()).String()
	const maxCrashes = 3
	for m := 1; m <= maxCrashes+2; m++ {
		counted := make(chan int, 1)
		h := g.member(map[string]func(*message.Message, int) error{poison: func(msg *message.Message, attempt int) error {
			if attempt == 1 {
				return errDependencyDown
			}
			return g.dies(counted)(msg, attempt)
		}})
		if warm {
			g.warm(h)
		}
		n, ended, err := g.deliver(func() error {
			msg := record(poison, "orders/0/10") // uncommitted: Kafka gives it back at each start
			_, err := h(msg)
			if errors.Is(err, errDependencyDown) {
				_, err = h(msg) // the chain's retry of the same message
			}
			return err
		}, counted)
		if ended {
			require.ErrorIs(t, err, inbox.ErrCrashLoop, "member %d: the delivery ended, not as a crash loop", m)
			t.Logf("dead-lettered at delivery %d", m)
			return
		}
		t.Logf("member %d killed; crash count %d", m, n)
	}
	t.Fatalf("the record killed %d members (MaxCrashes %d) and is not dead-lettered: its crash count is %d",
		maxCrashes+2, maxCrashes, g.e.crashCount("stock", poison))
}

// A partition that moves away from a member and back (a rebalance: member
// B joins while member A keeps running, then B dies and A is given its
// partitions back) finds A's mark of the last record A applied there. The
// poisoned record right after it kills B (counted: B never handled the
// record before it), then A, uncounted (it follows A's mark), then, A's
// restart having forgotten its marks, every member counts it: it is
// dead-lettered at delivery MaxCrashes+2, docs/transports.md's worst case
// ("MaxCrashes+2 when it reached a consumer … right after the record
// before it"), never later.
func TestKafkaRecordKillingAMemberAfterItsPartitionCameBackIsDeadLetteredAtTheWorstCaseBound(t *testing.T) {
	g := newMemberGroup(t)
	poison := uuid.Must(uuid.NewV7()).String()
	const maxCrashes = 3

	// Member A, warm, applies orders/0/9; the partition then moves to B.
	aHandlers := map[string]func(*message.Message, int) error{}
	a := g.member(aHandlers)
	g.warm(a)
	_, err := a(record(uuid.Must(uuid.NewV7()).String(), "orders/0/9"))
	require.NoError(t, err)

	// Member B, warm, is given orders/0 and dies on its next record.
	countedB := make(chan int, 1)
	b := g.member(map[string]func(*message.Message, int) error{poison: g.dies(countedB)})
	g.warm(b)
	nB, ended, err := g.deliver(func() error { _, err := b(record(poison, "orders/0/10")); return err }, countedB)
	require.False(t, ended, "B did not die: %v", err)
	require.Equal(t, 1, nB, "B's death was not counted")

	// B is gone: orders/0 goes back to A, at the uncommitted record.
	countedA := make(chan int, 1)
	g.mu.Lock()
	aHandlers[poison] = g.dies(countedA)
	g.mu.Unlock()
	nA, ended, err := g.deliver(func() error { _, err := a(record(poison, "orders/0/10")); return err }, countedA)
	require.False(t, ended, "A did not die: %v", err)
	require.Equal(t, 1, nA, "A, right after the record before it, counts nothing")

	// Every later member, restarted or new, counts it.
	for delivery := 3; delivery <= maxCrashes+2; delivery++ {
		counted := make(chan int, 1)
		h := g.member(map[string]func(*message.Message, int) error{poison: g.dies(counted)})
		g.warm(h)
		n, ended, err := g.deliver(func() error { _, err := h(record(poison, "orders/0/10")); return err }, counted)
		if ended {
			require.ErrorIs(t, err, inbox.ErrCrashLoop, "delivery %d ended, not as a crash loop", delivery)
			require.Equal(t, maxCrashes+2, delivery, "dead-lettered at delivery %d", delivery)
			return
		}
		require.Equal(t, delivery-1, n, "delivery %d: the death was not counted", delivery)
	}
	t.Fatalf("not dead-lettered at delivery %d", maxCrashes+2)
}

// A counted record's retry in the process (its first attempt failed)
// waits for the process's counted turn like its first attempt: the first
// record of another partition, counted and running, is never in flight
// when the retry kills the member, so its crash is the retry's alone
// (docs/guarantees.md: "records of other partitions in flight beside the
// killer are never counted with it"). The retry enters its handler only
// once the other record has ended: the other record is applied once and
// leaves no count; the poison's death is counted.
func TestKafkaRetryOfACountedRecordWaitsForTheCountedTurn(t *testing.T) {
	g := newMemberGroup(t)
	inbox.SetCountedTurnWait(time.Minute) // newMemberGroup's cleanup restores it
	poison, innocent := uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()
	innocentIn, release := make(chan struct{}), make(chan struct{})
	var released sync.Once
	releaseInnocent := func() { released.Do(func() { close(release) }) }
	t.Cleanup(releaseInnocent) // before the group's: its pool waits for the innocent's connection
	counted := make(chan int, 1)
	h := g.member(map[string]func(*message.Message, int) error{
		poison: func(msg *message.Message, attempt int) error {
			if attempt == 1 {
				return errDependencyDown
			}
			return g.dies(counted)(msg, attempt)
		},
		innocent: func(*message.Message, int) error {
			close(innocentIn)
			<-release
			return nil
		},
	})
	g.warm(h)
	poisonMsg := record(poison, "orders/0/10")
	_, err := h(poisonMsg)
	require.ErrorIs(t, err, errDependencyDown)

	innocentDone := make(chan error, 1)
	go func() {
		_, err := h(record(innocent, "payments/3/0")) // the first of its partition: counted, takes the turn
		innocentDone <- err
	}()
	<-innocentIn
	retryDone := make(chan error, 1)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		_, err := h(poisonMsg) // the chain's retry
		retryDone <- err
	}()
	select {
	case n := <-counted:
		t.Fatalf("the retry ran beside the counted record of another partition (its count %d, the other's %d)", n, g.e.crashCount("stock", innocent))
	case err := <-retryDone:
		t.Fatalf("the retry ended: %v", err)
	case <-time.After(300 * time.Millisecond): // still waiting for the turn
	}
	releaseInnocent()
	require.NoError(t, <-innocentDone)
	require.Equal(t, 1, <-counted, "the dying retry is counted")
	require.Equal(t, 0, g.e.crashCount("stock", innocent), "the record that ended before the death is counted with it")
	require.Equal(t, 1, g.e.count(`SELECT count(*) FROM effect WHERE event_id = $1`, innocent))
}
