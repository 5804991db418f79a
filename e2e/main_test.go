package e2e_test

import (
	"bytes"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// childEnv, when set, makes the test binary run a child role instead of the
// tests (see runChild).
const childEnv = "E2E_CHILD"

func TestMain(m *testing.M) {
	if role := os.Getenv(childEnv); role != "" {
		os.Exit(runChild(role))
	}
	os.Exit(m.Run())
}

// spawn re-executes the test binary as a child in role, with extra
// environment, and waits (at most 60 s) for it to end. It fails the test
// unless the child was killed by SIGKILL (its crash point fired).
func spawn(t *testing.T, role string, env ...string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), childEnv+"="+role), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("child %s did not reach its crash point within 60 s; output:\n%s", role, out.String())
	}
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL,
		"child %s must die by SIGKILL at its crash point; state %s; output:\n%s", role, cmd.ProcessState, out.String())
}
