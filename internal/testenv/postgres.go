package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultPostgresBinDir is where StartPostgres looks for initdb and
// postgres when PG_BINDIR is unset and none is found on PATH (the Debian
// layout of PostgreSQL 15).
const DefaultPostgresBinDir = "/usr/lib/postgresql/15/bin"

// Postgres is a private PostgreSQL server started by StartPostgres for one
// test: its own data directory, its own loopback port, its own settings.
// Nothing it does touches the shared server or the system's locales.
type Postgres struct {
	// URL reaches the server's "postgres" database as superuser "postgres"
	// (trust authentication, loopback only).
	URL string
	// Port is the loopback TCP port the server listens on.
	Port int
	// Dir holds the data directory ("data"), compiled locales ("locales")
	// and the server log ("log"); removed when the test ends.
	Dir string
}

// Log returns what the server logged so far (for failure messages).
func (p *Postgres) Log() string {
	b, _ := os.ReadFile(filepath.Join(p.Dir, "log"))
	return string(b)
}

// localeSettings are the server settings whose value names a locale.
var localeSettings = map[string]bool{"lc_messages": true, "lc_monetary": true, "lc_numeric": true, "lc_time": true}

// StartPostgres starts a private PostgreSQL server for the test and stops
// it (immediate shutdown) and removes its files when the test ends.
// settings are "name=value" server settings passed as -c options (e.g.
// "lc_messages=de_DE.UTF-8", "default_transaction_read_only=on").
//
// A locale named by lc_messages, lc_monetary, lc_numeric or lc_time in the
// form language_TERRITORY.CHARSET is compiled with localedef into the
// server's own directory and found through LOCPATH: nothing is installed
// system-wide and no root is needed. The server runs initdb into a
// temporary directory, listens on a free 127.0.0.1 port, with fsync off.
// Run as root, it runs the server as the "postgres" (else "nobody") user,
// as PostgreSQL refuses root.
//
// The binaries come from PG_BINDIR, else PATH, else
// DefaultPostgresBinDir. When a tool is missing the test is skipped, or
// fails under CI=true (a broken machine is never green in CI).
func StartPostgres(t testing.TB, settings ...string) *Postgres {
	t.Helper()
	bin := postgresBinDir()
	initdb, postgres := filepath.Join(bin, "initdb"), filepath.Join(bin, "postgres")
	for _, tool := range []string{initdb, postgres} {
		if _, err := os.Stat(tool); err != nil {
			missingTool(t, "%s not found (set PG_BINDIR or install: apt-get install -y postgresql): %v", tool, err)
		}
	}
	var args []string
	var locales []string
	for _, s := range settings {
		name, value, ok := strings.Cut(s, "=")
		if !ok || name == "" {
			t.Fatalf("testenv: StartPostgres: setting %q is not name=value", s)
		}
		if localeSettings[strings.ToLower(name)] && !builtinLocale(value) {
			locales = append(locales, value)
		}
		args = append(args, "-c", s)
	}

	dir, err := os.MkdirTemp("", "testenv-pg-")
	if err != nil {
		t.Fatalf("testenv: StartPostgres: %v", err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	p := &Postgres{Dir: dir}
	env := append(os.Environ(), "LC_ALL=C", "LANG=C", "LANGUAGE=")
	if len(locales) > 0 {
		locpath := filepath.Join(dir, "locales")
		if err := os.Mkdir(locpath, 0o755); err != nil {
			t.Fatalf("testenv: StartPostgres: %v", err)
		}
		for _, lc := range locales {
			compileLocale(t, locpath, lc)
		}
		env = append(env, "LOCPATH="+locpath)
	}
	cred := serverCredential(t, dir)

	var out bytes.Buffer
	cmd := exec.Command(initdb, "-D", filepath.Join(dir, "data"), "-U", "postgres", "--auth=trust",
		"--no-sync", "--no-instructions", "--encoding=UTF8", "--locale=C")
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = env, dir, &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if err := cmd.Run(); err != nil {
		t.Fatalf("testenv: StartPostgres: initdb: %v\n%s", err, out.String())
	}

	// A free port can be taken by someone else between the probe and the
	// server's bind: retry a few times with a new port.
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		port, err := freePort()
		if err != nil {
			t.Fatalf("testenv: StartPostgres: %v", err)
		}
		p.Port = port
		p.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
		if lastErr = p.start(t, postgres, args, env, cred); lastErr == nil {
			return p
		}
	}
	t.Fatalf("testenv: StartPostgres: %v\nserver log:\n%s", lastErr, p.Log())
	return nil
}

// start runs the server on p.Port and waits (at most 30 s) until it accepts
// a connection; the server is stopped when the test ends.
func (p *Postgres) start(t testing.TB, postgres string, settings, env []string, cred *syscall.Credential) error {
	logf, err := os.OpenFile(filepath.Join(p.Dir, "log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	args := append([]string{"-D", filepath.Join(p.Dir, "data"),
		"-c", "port=" + strconv.Itoa(p.Port), "-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=", "-c", "fsync=off", "-c", "full_page_writes=off",
		"-c", "synchronous_commit=off", "-c", "max_connections=50", "-c", "shared_buffers=16MB"}, settings...)
	cmd := exec.Command(postgres, args...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = env, p.Dir, logf, logf
	// Pdeathsig: a test binary killed by its timeout takes its server along.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGQUIT}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", postgres, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGQUIT) // immediate shutdown
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, p.URL)
		cancel()
		if err == nil {
			_ = conn.Close(context.Background())
			t.Cleanup(stop)
			return nil
		}
		select {
		case werr := <-exited:
			exited <- werr
			return fmt.Errorf("server on port %d exited: %v (last connect error: %v)", p.Port, werr, err)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			return fmt.Errorf("server on port %d not accepting connections within 30 s; last connect error: %v", p.Port, err)
		}
	}
}

// compileLocale compiles locale (language_TERRITORY.CHARSET) into locpath
// with localedef: no root, nothing system-wide.
func compileLocale(t testing.TB, locpath, locale string) {
	t.Helper()
	input, charmap, ok := strings.Cut(locale, ".")
	if !ok || input == "" || charmap == "" {
		t.Fatalf("testenv: StartPostgres: locale %q is not language_TERRITORY.CHARSET", locale)
	}
	if strings.EqualFold(charmap, "utf8") {
		charmap = "UTF-8"
	}
	localedef, err := exec.LookPath("localedef")
	if err != nil {
		missingTool(t, "localedef not found (apt-get install -y locales): %v", err)
	}
	out, err := exec.Command(localedef, "-i", input, "-f", charmap, filepath.Join(locpath, locale)).CombinedOutput()
	var exit *exec.ExitError
	// Exit status 1 means warnings only: the locale is written.
	if err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 1) {
		missingTool(t, "localedef -i %s -f %s: %v\n%s", input, charmap, err, out)
	}
	if _, err := os.Stat(filepath.Join(locpath, locale, "LC_MESSAGES")); err != nil {
		t.Fatalf("testenv: StartPostgres: localedef wrote no %s: %v\n%s", locale, err, out)
	}
}

func builtinLocale(v string) bool {
	switch strings.ToUpper(v) {
	case "", "C", "POSIX", "C.UTF-8", "C.UTF8":
		return true
	}
	return false
}

// serverCredential is nil unless the test runs as root; then it is the
// "postgres" (else "nobody") user, given ownership of dir.
func serverCredential(t testing.TB, dir string) *syscall.Credential {
	t.Helper()
	if os.Geteuid() != 0 {
		return nil
	}
	var u *user.User
	var err error
	for _, name := range []string{"postgres", "nobody"} {
		if u, err = user.Lookup(name); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("testenv: StartPostgres: running as root and no postgres or nobody user: %v", err)
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
		t.Fatalf("testenv: StartPostgres: chown %s: %v", dir, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// postgresBinDir is PG_BINDIR, else the directory of initdb on PATH, else
// the newest /usr/lib/postgresql/*/bin, else DefaultPostgresBinDir.
func postgresBinDir() string {
	if d := os.Getenv("PG_BINDIR"); d != "" {
		return d
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	if _, err := os.Stat(DefaultPostgresBinDir); err == nil {
		return DefaultPostgresBinDir
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	if len(dirs) > 0 {
		return dirs[0]
	}
	return DefaultPostgresBinDir
}

func versionOf(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

// freePort returns a loopback TCP port nobody listened on a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// missingTool skips the test, or fails it under CI=true.
func missingTool(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("testenv: "+format, args...)
	}
	t.Skipf("testenv: "+format+" (fails under CI=true)", args...)
}
