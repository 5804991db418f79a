package newuser_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

const childEnv = "NEWUSER_CHILD"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		os.Exit(runChild(spec))
	}
	os.Exit(m.Run())
}

// childSpec is what the parent hands its child process.
type childSpec struct {
	Names    names
	DBURL    string
	AMQPURL  string
	KillAt   string // a crashpoint name
	Deadline time.Duration
}

// stderrLogger writes ERROR lines to stderr, for the parent to read.
type stderrLogger struct{ watermill.NopLogger }

func (stderrLogger) Error(msg string, err error, f watermill.LogFields) {
	fmt.Fprintf(os.Stderr, "ERROR %s: %v %v\n", msg, err, f)
}
func (l stderrLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// runChild is one process of the README's service: it runs until it
// SIGKILLs itself at the named crash point (or the deadline passes).
func runChild(spec string) int {
	var s childSpec
	if err := json.Unmarshal([]byte(spec), &s); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	crashpoint.Set(func(name string) {
		if name == s.KillAt {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // never returns
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), s.Deadline)
	defer cancel()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	w := wiring{}
	if err := runStock(ctx, s.AMQPURL, s.DBURL, logger, s.Names, w); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	return 3 // the deadline passed without reaching the crash point
}

// crashChild starts a process of the service with names n, lets it take
// the next delivery and waits until it SIGKILLed itself at killAt.
func (e *env) crashChild(n names, killAt string, publish func()) {
	e.t.Helper()
	spec, _ := json.Marshal(childSpec{Names: n, DBURL: e.dbURL, AMQPURL: testenv.AMQPURL(), KillAt: killAt, Deadline: 90 * time.Second})
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	testenv.Eventually(e.t, 60*time.Second, "the child consumes", func(o *testenv.Observed) bool {
		return o.Int("consumers", e.consumers(n.Queue)) >= 1
	})
	publish()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			e.t.Fatalf("child: %v", err)
		}
		ws, ok := ee.Sys().(syscall.WaitStatus)
		if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
			e.t.Fatalf("child ended with %v, not SIGKILL at %s", err, killAt)
		}
	case <-time.After(120 * time.Second):
		_ = cmd.Process.Kill()
		e.t.Fatalf("child did not reach %s", killAt)
	}
}

// A process of the README's service is SIGKILLed at each crash point
// (after the claim, before COMMIT, after COMMIT and before the ack); a
// second process with the same Consumer gets the redelivery. The effect is
// applied once, nothing is dead-lettered and the queue is empty.
func TestCrashAtEveryPointThenRedelivery(t *testing.T) {
	t.Parallel()
	for _, point := range []string{crashpoint.AfterClaim, crashpoint.BeforeCommit, crashpoint.AfterCommit} {
		t.Run(point, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.crashChild(e.n, point, func() { e.order("A", 1) })
			e.start(e.n, wiring{})
			testenv.Eventually(t, 60*time.Second, "the redelivery settled", func(o *testenv.Observed) bool {
				return o.Int("settled", e.logs.settledDeliveries()) >= 1
			})
			if n := e.reservations("A"); n != 1 {
				t.Fatalf("crash at %s: %d reservations, want 1", point, n)
			}
			if n, _ := e.depth(e.n.DLQ); n != 0 {
				t.Fatalf("crash at %s: %d dead-lettered, want 0", point, n)
			}
		})
	}
}

// lockedBuffer is a bytes.Buffer safe for the child's stderr copier and the
// test's reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
