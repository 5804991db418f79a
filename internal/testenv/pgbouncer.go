package testenv

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PgBouncer is a private PgBouncer started by StartPgBouncer for one test,
// in front of the PostgreSQL server of PostgresURL.
type PgBouncer struct {
	// URL reaches the server's database through the pooler, as
	// PostgresURL's user (trust authentication, loopback only).
	URL string
	// Port is the loopback TCP port the pooler listens on.
	Port int
	// Dir holds the configuration, the auth file and the log.
	Dir string
	// Mode is the pool_mode: "session", "transaction" or "statement".
	Mode string
}

// Log returns what the pooler logged so far (for failure messages).
func (b *PgBouncer) Log() string {
	out, _ := os.ReadFile(filepath.Join(b.Dir, "log"))
	return string(out)
}

// StartPgBouncer starts a PgBouncer in pool mode mode on a free loopback
// port, pointing at the server of PostgresURL (its host, port, database and
// user), and stops it when the test ends. settings are extra "name = value"
// lines of the [pgbouncer] section (e.g. "default_pool_size = 2",
// "max_prepared_statements = 0" on 1.21+). A missing pgbouncer binary
// skips the test, or fails it under CI=true.
func StartPgBouncer(t testing.TB, mode string, settings ...string) *PgBouncer {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			missingTool(t, "pgbouncer not found (apt-get install -y pgbouncer): %v", err)
		}
		bin = "/usr/sbin/pgbouncer"
	}
	return startPgBouncer(t, bin, mode, settings...)
}

// NewerPgBouncerEnv names the PgBouncer 1.21+ binary the pooler tests also
// run against (scripts/pgbouncer-newer.sh builds 1.24.1 and prints its
// path; .ci/run sets it). Debian bookworm's package is 1.18, which has no
// max_prepared_statements.
const NewerPgBouncerEnv = "IDEMPOTENCY_PGBOUNCER_NEWER"

// StartNewerPgBouncer is StartPgBouncer with the binary of
// NewerPgBouncerEnv. Unset, the test is skipped, or fails under CI=true.
func StartNewerPgBouncer(t testing.TB, mode string, settings ...string) *PgBouncer {
	t.Helper()
	bin := os.Getenv(NewerPgBouncerEnv)
	if bin == "" {
		missingTool(t, "%s is not set (bash scripts/pgbouncer-newer.sh builds PgBouncer 1.24 and prints its path)", NewerPgBouncerEnv)
	}
	return startPgBouncer(t, bin, mode, settings...)
}

func startPgBouncer(t testing.TB, bin, mode string, settings ...string) *PgBouncer {
	t.Helper()
	target, err := url.Parse(PostgresURL())
	if err != nil {
		t.Fatalf("testenv: StartPgBouncer: %s: %v", PostgresURL(), err)
	}
	host, port := target.Hostname(), target.Port()
	if port == "" {
		port = "5432"
	}
	dbname := strings.TrimPrefix(target.Path, "/")
	userName := target.User.Username()
	// A directory of its own under the system's temporary directory (not
	// t.TempDir: its parent is private to root, and the pooler may run as
	// postgres).
	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		t.Fatalf("testenv: StartPgBouncer: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatalf("testenv: StartPgBouncer: %v", err)
	}
	var lastErr error
	for try := 0; try < 3; try++ {
		p, err := freePort()
		if err != nil {
			t.Fatalf("testenv: StartPgBouncer: free port: %v", err)
		}
		b := &PgBouncer{Port: p, Dir: dir, Mode: mode,
			URL: fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", userName, p, dbname)}
		ini := fmt.Sprintf(`[databases]
%[1]s = host=%[2]s port=%[3]s dbname=%[1]s user=%[4]s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %[5]d
unix_socket_dir =
auth_type = trust
auth_file = %[6]s
pool_mode = %[7]s
max_client_conn = 200
default_pool_size = 4
ignore_startup_parameters = extra_float_digits
logfile = %[8]s
pidfile = %[9]s
%[10]s
`, dbname, host, port, userName, p, filepath.Join(dir, "users.txt"), mode,
			filepath.Join(dir, "log"), filepath.Join(dir, "pid"), strings.Join(settings, "\n"))
		if err := os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644); err != nil {
			t.Fatalf("testenv: StartPgBouncer: %v", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "users.txt"), []byte(strconv.Quote(userName)+` ""`+"\n"), 0o644); err != nil {
			t.Fatalf("testenv: StartPgBouncer: %v", err)
		}
		if lastErr = b.start(t, bin); lastErr == nil {
			return b
		}
	}
	t.Fatalf("testenv: StartPgBouncer: %v\npooler log:\n%s", lastErr, (&PgBouncer{Dir: dir}).Log())
	return nil
}

// start runs the pooler and waits (at most 20 s) until a connection through
// it reaches the server; the pooler is stopped when the test ends.
func (b *PgBouncer) start(t testing.TB, bin string) error {
	cmd := exec.Command(bin, filepath.Join(b.Dir, "pgbouncer.ini"))
	cmd.Dir = b.Dir
	// PgBouncer refuses to run as root: run it as postgres (else nobody).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if os.Geteuid() == 0 {
		cred, err := unprivileged(b.Dir)
		if err != nil {
			return err
		}
		cmd.SysProcAttr.Credential = cred
	}
	out, err := os.OpenFile(filepath.Join(b.Dir, "stderr"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGINT) // immediate shutdown
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, b.URL)
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1", pgx.QueryExecModeSimpleProtocol)
			_ = conn.Close(context.Background())
		}
		cancel()
		if err == nil {
			t.Cleanup(stop)
			return nil
		}
		select {
		case werr := <-exited:
			stderr, _ := os.ReadFile(filepath.Join(b.Dir, "stderr"))
			return fmt.Errorf("pgbouncer on port %d exited: %v (last connect error: %v)\n%s", b.Port, werr, err, stderr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return fmt.Errorf("pgbouncer on port %d not accepting connections within 20 s; last connect error: %v", b.Port, err)
		}
	}
}

// unprivileged is the postgres (else nobody) user, given ownership of dir.
func unprivileged(dir string) (*syscall.Credential, error) {
	var u *user.User
	var err error
	for _, name := range []string{"postgres", "nobody"} {
		if u, err = user.Lookup(name); err == nil {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("running as root and no postgres or nobody user: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	err = filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(path, uid, gid)
	})
	if err != nil {
		return nil, fmt.Errorf("chown %s: %w", dir, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// PoolBehind returns a pool through the pooler in exec mode mode (pgx's
// default is pgx.QueryExecModeCacheStatement), with at most maxConns
// connections, closed when the test ends. PgBouncer forwards no
// search_path: name tables with their schema.
func (b *PgBouncer) PoolBehind(t testing.TB, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(b.URL)
	if err != nil {
		t.Fatalf("testenv: parse %s: %v", b.URL, err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("testenv: pool behind pgbouncer: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// OtherClients keeps b's server connections changing hands until the test
// ends, as other services sharing the pooler do: n clients of their own,
// each sending short statements (SELECT pg_sleep(0.002)) one after another.
func (b *PgBouncer) OtherClients(t testing.TB, n int) {
	t.Helper()
	others := b.PoolBehind(t, pgx.QueryExecModeSimpleProtocol, int32(n))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				_, _ = others.Exec(context.Background(), `SELECT pg_sleep(0.002)`)
			}
		}()
	}
	t.Cleanup(func() { close(stop); wg.Wait() })
}

// PoolerSetup is one PgBouncer of the transaction-pooler tests.
type PoolerSetup struct {
	// Name names the subtest.
	Name string
	// Newer starts StartNewerPgBouncer (1.24) instead of Debian's 1.18.
	Newer bool
	// TracksPrepared: the pooler tracks named prepared statements
	// (max_prepared_statements above 0, PgBouncer 1.21+).
	TracksPrepared bool
	// Settings are extra [pgbouncer] lines.
	Settings []string
}

// TransactionPoolers are the pooler tests' setups: Debian's 1.18, and 1.24
// without and with prepared-statement tracking.
var TransactionPoolers = []PoolerSetup{
	{Name: "1.18"},
	{Name: "1.24-unprepared", Newer: true, Settings: []string{"max_prepared_statements = 0"}},
	{Name: "1.24-prepared", Newer: true, TracksPrepared: true, Settings: []string{"max_prepared_statements = 200"}},
}

// ExecModes are pgx's five query exec modes.
var ExecModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// EachPoolerExecMode starts each of setups in transaction pooling
// (default_pool_size = 3 plus its Settings) in a parallel subtest, calls
// started once with it (nil: nothing), and runs f in a parallel subtest per
// exec mode (ExecModes): the modes of one pooler share its server
// connections, as services do.
func EachPoolerExecMode(t *testing.T, setups []PoolerSetup, started func(t *testing.T, b *PgBouncer),
	f func(t *testing.T, b *PgBouncer, setup PoolerSetup, mode pgx.QueryExecMode)) {
	for _, setup := range setups {
		t.Run(setup.Name, func(t *testing.T) {
			t.Parallel()
			start := StartPgBouncer
			if setup.Newer {
				start = StartNewerPgBouncer
			}
			b := start(t, "transaction", append([]string{"default_pool_size = 3"}, setup.Settings...)...)
			if started != nil {
				started(t, b)
			}
			for _, mode := range ExecModes {
				t.Run(mode.String(), func(t *testing.T) {
					t.Parallel()
					f(t, b, setup, mode)
				})
			}
		})
	}
}
