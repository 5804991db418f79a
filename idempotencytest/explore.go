package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

// Fault is how Explore fails an attempt at a point.
type Fault string

// The faults Explore injects at every point.
const (
	// FaultError fails the statement (or the commit) with an error: the
	// attempt rolls back and the chain retries it.
	FaultError Fault = "error"
	// FaultPanic panics in the handler at the point: the chain recovers,
	// rolls back and retries.
	FaultPanic Fault = "panic"
	// FaultConnLost closes the attempt's connection at the point: the
	// server rolls the transaction back, as after a crash of the process.
	FaultConnLost Fault = "connection lost"
)

// errInjected is the error FaultError injects.
var errInjected = errors.New("idempotencytest: injected fault")

// errPoisoned is what Explore's delivery returns when the consumer's chain
// poisoned the message: the chain returns nil (acked) and the broker never
// redelivers it.
var errPoisoned = errors.New("poisoned (dead-lettered) instead of applied")

// Divergence is a point where a failed attempt, once redelivered until it
// succeeded, left other effects than the clean delivery.
type Divergence struct {
	// Point names where the attempt failed: "before statement 2", "after
	// statement 1", "before commit", "after commit (ack lost)".
	Point string
	// Statement is the SQL text of the statement at Point ("" for the
	// commit points).
	Statement string
	// Fault is the failure injected there.
	Fault Fault
	// Effects is what Subject.Effects returned after the redeliveries;
	// Want what it returned after the clean delivery.
	Effects, Want int
	// Err is set when the message never succeeded (it was redelivered
	// maxRedeliveries times, or the consumer's chain poisoned it) or
	// Effects failed.
	Err error
}

func (d Divergence) describe() string {
	at := d.Point
	if d.Statement != "" {
		at += " (" + oneLine(d.Statement) + ")"
	}
	if d.Err != nil {
		return fmt.Sprintf("%s at %s: %v", d.Fault, at, d.Err)
	}
	return fmt.Sprintf("%s at %s: %d effects after redelivery, %d after a clean delivery", d.Fault, at, d.Effects, d.Want)
}

// ExploreReport is what Explore found.
type ExploreReport struct {
	// Statements are the handler's statements on the attempt's transaction
	// in the clean delivery, in order.
	Statements []string
	// Points is how many (point, fault) pairs were tried.
	Points int
	// Divergences lists every pair whose effects differed, in order.
	Divergences []Divergence
}

// maxRedeliveries bounds how often Explore redelivers a message after the
// injected failure before it reports that the message never succeeded.
const maxRedeliveries = 5

// Explore proves that a handler applies its effects once whatever fails
// where. It delivers a copy of msg cleanly (the reference: Effects after
// it, and the statements the handler sends on the attempt's transaction,
// a savepoint's and CopyFrom included; statements sent through tx.Conn()
// are not seen, reported when the handler sent none on the transaction),
// then, for every point — before and after each of those statements, before
// the commit, and after the commit with the ack lost — and every Fault, a
// fresh copy (a new event_id, same payload and metadata) on which the first
// attempt fails at that point; it redelivers that copy until a delivery
// succeeds and compares Effects with the reference. Every difference is
// reported through t, with the point, the statement text and the counts;
// the first one tells which line voids the guarantee:
//   - a write through a pool or *sql.DB instead of the attempt's
//     transaction survives the rollback and is written again;
//   - an external call without an operation key (count it with Provider)
//     is made again by the redelivery;
//   - a transaction ended by the handler (COMMIT, ROLLBACK) commits its
//     effect outside the claim, or fails every attempt.
//
// Effects must count the effects of the message it is given by that
// message's event_id (msg.UUID): each copy has its own. The copies share
// the payload: a handler that also deduplicates by a business key in it
// writes nothing for them, which reads as lost effects; count its effects
// by that key instead (the same for every copy). Statement points
// need a pgx DB (idempotency.Pgx); on database/sql only the commit points
// are explored. The consumer's retries stand for redeliveries: keep
// RetryConfig.MaxRetries ≥ 1. The clean delivery must leave WantEffects
// (default 1) and must not be poisoned; a delivery the chain poisons is
// reported with its reason.
func Explore(t TB, s Subject, msg *message.Message) ExploreReport {
	t.Helper()
	var rep ExploreReport
	if s.Handler == nil || s.Consumer == nil || s.Effects == nil || msg == nil {
		t.Errorf("idempotencytest.Explore: Subject.Handler, Subject.Consumer, Subject.Effects and the message are required")
		return rep
	}
	timeout := s.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	h, err := door.Wrap(s.Consumer, "idempotencytest", s.Handler)
	if err != nil {
		t.Errorf("idempotencytest.Explore: Subject.Consumer: %v", err)
		return rep
	}
	deliver := func(ctx context.Context, m *message.Message, f inbox.Faults) error {
		var (
			mu       sync.Mutex
			poisoned []string
		)
		ctx = inbox.WithPoisonNotice(ctx, func(reason string) {
			mu.Lock()
			poisoned = append(poisoned, reason)
			mu.Unlock()
		})
		c := m.Copy()
		c.SetContext(inbox.WithFaults(ctx, f))
		if err := safeCall(h, c); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if len(poisoned) > 0 {
			return fmt.Errorf("%w: %s", errPoisoned, strings.Join(poisoned, "; "))
		}
		return nil
	}

	// The reference. It and each point have Timeout of their own: the
	// points grow with the handler's statements (each one's redelivery
	// waits the consumer's retry backoff), so one budget for all of them
	// failed a correct handler of thirty statements at its last points.
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	rec := &injector{}
	ref := fresh(msg)
	if err := deliver(ctx, ref, rec); err != nil {
		if errors.Is(err, errPoisoned) {
			t.Errorf("idempotencytest.Explore: the clean delivery was %v", err)
		} else {
			t.Errorf("idempotencytest.Explore: the clean delivery failed: %v", err)
		}
		return rep
	}
	want, err := s.Effects(ctx, ref)
	if err != nil {
		t.Errorf("idempotencytest.Explore: Effects after the clean delivery: %v", err)
		return rep
	}
	w := s.WantEffects
	if w == 0 {
		w = 1
	}
	if want != w {
		t.Errorf("idempotencytest.Explore: %d effects after the clean delivery, want %d", want, w)
	}
	rep.Statements = rec.seen
	if len(rec.seen) == 0 {
		// Nothing on the transaction itself: a handler that sent its
		// statements through the connection would pass unexplored.
		for _, what := range rec.unhooked {
			t.Errorf("idempotencytest.Explore: the handler sent no statement on the attempt's transaction but used %s: "+
				"what it sends there is not explored; send it on the transaction (Exec, Query, SendBatch, CopyFrom, Begin for a savepoint)", what)
		}
	}

	type point struct {
		name, stmt string
		arm        func(*injector)
	}
	var points []point
	for i, stmt := range rec.seen {
		points = append(points,
			point{fmt.Sprintf("before statement %d", i+1), stmt, func(in *injector) { in.at, in.after = i, false }},
			point{fmt.Sprintf("after statement %d", i+1), stmt, func(in *injector) { in.at, in.after = i, true }})
	}
	points = append(points, point{"before commit", "", func(in *injector) { in.at, in.commit = -1, true }})

	for _, p := range points {
		for _, fault := range []Fault{FaultError, FaultPanic, FaultConnLost} {
			rep.Points++
			in := &injector{fault: fault}
			p.arm(in)
			d := Divergence{Point: p.name, Statement: p.stmt, Fault: fault, Want: want}
			pctx, pcancel := context.WithTimeout(context.Background(), timeout)
			if diverged(pctx, s, deliver, in, msg, &d) {
				rep.Divergences = append(rep.Divergences, d)
			}
			pcancel()
		}
	}
	// The ack lost after the commit: the broker redelivers a processed
	// message.
	rep.Points++
	d := Divergence{Point: "after commit (ack lost)", Fault: FaultError, Want: want}
	ctx, cancel = context.WithTimeout(context.Background(), timeout)
	defer cancel()
	m := fresh(msg)
	var errs []error
	for i := 0; i < 2; i++ {
		if err := deliver(ctx, m, &injector{at: -1}); err != nil {
			errs = append(errs, err)
		}
	}
	d.Effects, d.Err = s.Effects(ctx, m)
	if d.Err == nil && len(errs) > 0 {
		d.Err = fmt.Errorf("redelivery failed: %w", errors.Join(errs...))
	}
	if d.Err != nil || d.Effects != want {
		rep.Divergences = append(rep.Divergences, d)
	}

	for _, d := range rep.Divergences {
		t.Errorf("idempotencytest.Explore: %s", d.describe())
	}
	return rep
}

// diverged runs one exploration: the first attempt fails as in armed, then
// the message is redelivered until a delivery succeeds.
func diverged(ctx context.Context, s Subject, deliver func(context.Context, *message.Message, inbox.Faults) error,
	in *injector, msg *message.Message, d *Divergence) bool {
	m := fresh(msg)
	var last error
	ok := false
	for i := 0; i < maxRedeliveries && !ok; i++ {
		last = deliver(ctx, m, in)
		ok = last == nil
		if errors.Is(last, errPoisoned) {
			// Acked: the broker would not redeliver it.
			d.Err = last
			return true
		}
	}
	if !ok {
		d.Err = fmt.Errorf("never succeeded in %d deliveries: %w", maxRedeliveries, last)
		return true
	}
	d.Effects, d.Err = s.Effects(ctx, m)
	return d.Err != nil || d.Effects != d.Want
}

// fresh is a copy of msg under a new event_id.
func fresh(msg *message.Message) *message.Message {
	c := msg.Copy()
	c.UUID = uuid.Must(uuid.NewV7()).String()
	return c
}

// injector records the handler's statements and fails the first attempt
// at its armed point, once.
type injector struct {
	mu     sync.Mutex
	seen   []string
	n      int  // statements seen in the current attempt
	at     int  // the statement index to fail at; -1: none
	after  bool // fail after the statement, not before
	commit bool // fail before the commit
	fault  Fault
	fired  bool
	// unhooked: what the handler sent statements through that the hooks
	// do not see (inbox.Unhooked), once each.
	unhooked []string
}

func (in *injector) Unhooked(what string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if !slices.Contains(in.unhooked, what) {
		in.unhooked = append(in.unhooked, what)
	}
}

func (in *injector) Statement(_ context.Context, sql string, after bool) error {
	in.mu.Lock()
	i := in.n
	if after {
		in.n++
		if in.fault == "" {
			in.seen = append(in.seen, sql)
		}
	}
	fire := !in.fired && in.fault != "" && !in.commit && in.at == i && in.after == after
	if fire {
		in.fired = true
	}
	in.mu.Unlock()
	if !fire {
		return nil
	}
	return in.fail()
}

func (in *injector) BeforeCommit() error {
	in.mu.Lock()
	in.n = 0 // the next attempt counts its statements from the start
	fire := !in.fired && in.fault != "" && in.commit
	if fire {
		in.fired = true
	}
	in.mu.Unlock()
	if !fire {
		return nil
	}
	return in.fail()
}

func (in *injector) fail() error {
	switch in.fault {
	case FaultPanic:
		panic(errInjected)
	case FaultConnLost:
		return inbox.ErrFaultConnLost
	default:
		return errInjected
	}
}

func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 120 {
		s = s[:117] + "..."
	}
	return s
}

// Provider is a counting fake of an external service (a payment provider,
// a mailer): Call records one call per key. Use it in a handler under test
// and count its calls in Subject.Effects, so that Explore shows whether a
// failure after the call makes the redelivery call again (an external
// effect without an operation key). Safe for concurrent use.
type Provider struct {
	mu    sync.Mutex
	calls map[string]int
}

// Call records a call for key.
func (p *Provider) Call(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.calls == nil {
		p.calls = map[string]int{}
	}
	p.calls[key]++
}

// Calls returns how many times Call was called with key.
func (p *Provider) Calls(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[key]
}
