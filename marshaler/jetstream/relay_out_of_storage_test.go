package jetstream

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// startQuotaNATS starts a private nats-server on a free loopback port whose
// account "app" may store at most 64 KiB on file (memory: 8 MiB), and
// returns a URL for that account.
func startQuotaNATS(t *testing.T, serverWide bool) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	dir := t.TempDir()
	conf := fmt.Sprintf(`listen: 127.0.0.1:%d
jetstream { store_dir: %q }
accounts {
  app: { jetstream: { max_file: 65536, max_mem: 8388608 }, users: [ { user: app, password: app } ] }
}
`, port, filepath.Join(dir, "js"))
	if serverWide { // the server's own file store is full (no account quota)
		conf = fmt.Sprintf(`listen: 127.0.0.1:%d
jetstream { store_dir: %q, max_file_store: 65536, max_memory_store: 8388608 }
accounts {
  app: { jetstream: enabled, users: [ { user: app, password: app } ] }
}
`, port, filepath.Join(dir, "js"))
	}
	cf := filepath.Join(dir, "nats.conf")
	require.NoError(t, os.WriteFile(cf, []byte(conf), 0o600))
	cmd := exec.Command("/usr/sbin/nats-server", "-c", cf)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := fmt.Sprintf("nats://app:app@127.0.0.1:%d", port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		nc, err := nats.Connect(url)
		if err == nil {
			nc.Close()
			return url
		}
		if time.Now().After(deadline) {
			t.Fatalf("private nats-server did not start: %v\n%s", err, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A JetStream account at its storage quota ("resource limits exceeded for
// account"), or a server whose file store is full, is the server out of storage: back-pressure (producer.md: "a
// JetStream server out of storage or memory ... never counts either").
// The relay's row waits, past MaxAttempts, while the probe stream (in
// memory, under its own quota) shows the server up; it is never
// dead-lettered, and goes out once room is made.
func TestRelayJetStreamOutOfFileStorageIsBackPressure(t *testing.T) {
	t.Parallel()
	t.Run("AccountQuota", func(t *testing.T) { testRelayOutOfFileStorage(t, false) })
	t.Run("ServerStore", func(t *testing.T) { testRelayOutOfFileStorage(t, true) })
}

func testRelayOutOfFileStorage(t *testing.T, serverWide bool) {
	url := startQuotaNATS(t, serverWide)
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AddStream(&nats.StreamConfig{Name: "EVENTS", Subjects: []string{"EVENTS.>"}, Storage: nats.FileStorage})
	require.NoError(t, err)
	_, err = js.AddStream(&nats.StreamConfig{Name: "PROBE", Subjects: []string{"PROBE.>"}, Storage: nats.MemoryStorage, MaxMsgs: 10})
	require.NoError(t, err)
	// Fill the account's file quota.
	var fillErr error
	for _, size := range []int{4096, 256, 16, 1} {
		fillErr = nil
		for i := 0; i < 5000 && fillErr == nil; i++ {
			_, fillErr = js.Publish("EVENTS.fill", make([]byte, size))
		}
	}
	require.Error(t, fillErr, "the account's file quota is reached")
	t.Logf("a publish at the quota: %v", fillErr)

	f := newRelayFixture(t)
	f.url, f.js, f.probe = url, js, "PROBE.probe"
	id := f.write(t, "EVENTS.order")
	rec := f.run(t, relayMaxAttempts)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		_, failed, _, dead := rec.counts()
		if failed > 3*relayMaxAttempts || dead > 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, failed, pressured, dead := rec.counts()
	pending, deadRows := f.rows(t)
	t.Logf("failed %d, back-pressured %d, dead %d; outbox pending %d, dead rows %d", failed, pressured, dead, pending, deadRows)
	require.Zero(t, deadRows, "a row is dead-lettered because JetStream is out of file storage")
	require.Equal(t, 1, pending)
	require.NoError(t, js.PurgeStream("EVENTS"))
	require.Eventually(t, func() bool { return f.stored(t, "EVENTS.order") == id }, 20*time.Second, 20*time.Millisecond, "delivered once room is made")
}
