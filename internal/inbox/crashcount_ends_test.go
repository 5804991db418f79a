package inbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// crashCount is the started count of (consumer, id) in processed_event_crash
// (0 when there is no row).
func (e *env) crashCount(consumer, id string) int {
	return e.count(`SELECT coalesce((SELECT started FROM processed_event_crash WHERE consumer = $1 AND event_id = $2), 0)`, consumer, id)
}

// crashed records n attempts of (consumer, id) that started and never ended
// (the process died in them), as startAttempt writes them.
func (e *env) crashed(consumer, id string, n int) {
	e.t.Helper()
	for i := 0; i < n; i++ {
		_, err := e.store.StartAttempt(context.Background(), sqldb.Pgx(e.pool), consumer, uuid.MustParse(id))
		require.NoError(e.t, err)
	}
}

// refusing is the crash count's connection while the database cannot be
// reached: while refuse > 0 a statement fails before it is sent.
type refusing struct {
	sqldb.Querier
	refuse atomic.Int32
}

var errRefused = errors.New("test: connection refused")

func (q *refusing) take() bool {
	for {
		n := q.refuse.Load()
		if n <= 0 {
			return false
		}
		if q.refuse.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

func (q *refusing) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	if q.take() {
		return 0, errRefused
	}
	return q.Querier.Exec(ctx, query, args...)
}

func (q *refusing) QueryRow(ctx context.Context, query string, args ...any) sqldb.Row {
	if q.take() {
		return errRow{}
	}
	return q.Querier.QueryRow(ctx, query, args...)
}

type errRow struct{}

func (errRow) Scan(...any) error { return errRefused }

// docs/guarantees.md: attempts are counted "one more at its start, one less
// at its end", and "an end the database could not take is kept in the
// process and written before its next attempt of any event". The end owed
// for a start whose answer was lost must be written once. Here it is owed
// while its own attempt is still running: another delivery handled by the
// process meanwhile pays it (payOwedEnds), and the attempt pays it again
// when it ends. Two earlier crashes of the event must stay counted.
func TestOwedEndOfARunningAttemptIsWrittenOnce(t *testing.T) {
	e := newEnv(t)
	counts := &lostAnswers{Querier: sqldb.Pgx(e.pool)}
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = counts
	})
	crashing, other := countedMsg(true), countedMsg(false)
	e.crashed("stock", crashing.UUID, 2) // two attempts died

	in, out := make(chan struct{}), make(chan struct{})
	handler := h(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == crashing.UUID {
			close(in)
			<-out
			return nil, errors.New("handler failed")
		}
		return nil, writeEffect(msg, "")
	})
	counts.lose.Store(1) // the start commits, its answer is lost
	done := make(chan error, 1)
	go func() {
		_, err := handler(crashing)
		done <- err
	}()
	<-in
	require.Equal(t, 3, e.crashCount("stock", crashing.UUID), "the start was written")
	_, err := handler(other) // any other delivery of the process meanwhile
	require.NoError(t, err)
	close(out)
	require.Error(t, <-done)
	require.Equal(t, 2, e.crashCount("stock", crashing.UUID),
		"the owed end of one attempt was written twice: a crash of the event was erased")
}

// docs/guarantees.md: "one more at its start, one less at its end". An
// attempt whose start the database never received (the connection was
// refused before the statement was sent) must not take one of the event's
// crashes away when it ends.
func TestAttemptWhoseStartWasNeverSentEndsNoCrash(t *testing.T) {
	e := newEnv(t)
	counts := &refusing{Querier: sqldb.Pgx(e.pool)}
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = counts
	})
	msg := countedMsg(true)
	e.crashed("stock", msg.UUID, 2) // two attempts died
	handler := h(func(msg *message.Message) ([]*message.Message, error) {
		return nil, errors.New("handler failed")
	})
	counts.refuse.Store(1) // the start's first statement never reaches the database
	_, err := handler(msg)
	require.Error(t, err)
	require.Equal(t, 2, e.crashCount("stock", msg.UUID),
		"an attempt that wrote no start wrote an end: a crash of the event was erased")
}

// MaxCrashes: the count is "deleted when the event is processed or
// dead-lettered". A redelivery that fails as permanent is dead-lettered
// (the poison topic) with its event's earlier crashes still counted: a
// redrive of it inherits them and is dead-lettered as a crash loop after
// fewer than MaxCrashes crashes of its own ("at the MaxCrashes+2nd
// delivery on a marking transport").
func TestPoisonedMessageLeavesNoCrashCountForItsRedrive(t *testing.T) {
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
		MaxCrashes: 3, CrashQuerier: sqldb.Pgx(e.pool),
	}, watermill.NopLogger{})
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 8)}
	var fixed atomic.Bool
	h := chainedHold(t, idem, poison, watermill.NopLogger{}, 20*time.Second, func(msg *message.Message) ([]*message.Message, error) {
		if !fixed.Load() {
			return nil, inbox.Permanent(errors.New("bad payload"))
		}
		return nil, writeEffect(msg, "")
	})
	id := uuid.Must(uuid.NewV7()).String()
	e.crashed("stock", id, 2) // two attempts died, then the third failed as permanent
	msg := newMsg(id)
	marshaler.SetRedelivered(msg, true)
	_, err = h(msg)
	require.NoError(t, err)
	require.Len(t, poison.msgs, 1, "dead-lettered")
	<-poison.msgs
	assert.Zero(t, e.crashCount("stock", id), "the dead-lettered message's crash count is left behind")

	// The redrive (the bug fixed): its first delivery crashes (counted
	// nowhere), its second crashes (one start, never ended); its third
	// must run the handler.
	fixed.Store(true)
	e.crashed("stock", id, 1)
	redrive := newMsg(id)
	marshaler.SetRedelivered(redrive, true)
	_, err = h(redrive)
	require.NoError(t, err)
	if len(poison.msgs) > 0 {
		pm := <-poison.msgs
		t.Fatalf("the redrive was dead-lettered after two crashes of its own: %s", pm.Metadata.Get("reason_poisoned"))
	}
	require.Equal(t, 1, e.effects(id))
}

// endsGate is the crash count's connection: while refuse is set an end's
// UPDATE fails before it is sent; while armed, the first end to arrive
// waits until a second arrives or until released (the other attempt got
// past paying without writing).
type endsGate struct {
	sqldb.Querier
	refuse  atomic.Bool
	armed   atomic.Bool
	arrived atomic.Int32
	second  chan struct{}
	release chan struct{}
}

func (q *endsGate) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	if strings.HasPrefix(query, "UPDATE") {
		if q.refuse.Load() {
			return 0, errRefused
		}
		if q.armed.Load() {
			switch q.arrived.Add(1) {
			case 1:
				select {
				case <-q.second:
				case <-q.release:
				}
			case 2:
				close(q.second)
			}
		}
	}
	return q.Querier.Exec(ctx, query, args...)
}

// An end owed by the process (the database could not take it) is written
// once, though two attempts of the process start at the same moment: each
// reads the owed ends (payOwedEnds) and writes them all before removing
// them. Two earlier crashes of the event must stay counted.
func TestOwedEndIsWrittenOnceByConcurrentAttempts(t *testing.T) {
	e := newEnv(t)
	counts := &endsGate{Querier: sqldb.Pgx(e.pool), second: make(chan struct{}), release: make(chan struct{})}
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.MaxCrashes = 3
		c.CrashQuerier = counts
	})
	crashing := countedMsg(true)
	e.crashed("stock", crashing.UUID, 2) // two attempts died
	var releaseOnce sync.Once
	handler := h(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == crashing.UUID {
			return nil, errors.New("handler failed")
		}
		releaseOnce.Do(func() { close(counts.release) }) // got past paying
		return nil, writeEffect(msg, "")
	})
	counts.refuse.Store(true) // the end cannot be written: owed
	_, err := handler(crashing)
	require.Error(t, err)
	counts.refuse.Store(false)
	require.Equal(t, 3, e.crashCount("stock", crashing.UUID))

	counts.armed.Store(true)
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := handler(countedMsg(false)) // first deliveries of other events
			assert.NoError(t, err)
		}()
	}
	wg.Wait()
	require.Equal(t, 2, e.crashCount("stock", crashing.UUID),
		"one owed end was written by both attempts: a crash of the event was erased")
}
