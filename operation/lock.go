package operation

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// keyLocker is a dialect's lock on one operation key. An attempt holds it
// from before its started record is committed until its outcome is
// recorded, through the external call: whoever finds it free while the
// record is started with an owner knows that owner is gone.
type keyLocker interface {
	// try takes the lock if it is free, without waiting.
	try(ctx context.Context, c conn, k *lockKey) (bool, error)
	// wait waits up to d for the lock. timedOut, non-nil when d passed
	// first, describes the timeout; err is any other failure, after which
	// the lock's state is unknown.
	wait(ctx context.Context, c conn, k *lockKey, d time.Duration) (timedOut, err error)
	// unlock releases the lock; held is false when c did not hold it.
	unlock(ctx context.Context, c conn, k *lockKey) (held bool, err error)
	// session reports whether the lock belongs to c's database session, so
	// that closing the connection releases it (PostgreSQL, MySQL), rather
	// than to the process (SQLite).
	session() bool
}

// lockKey identifies one key's lock.
type lockKey struct {
	key    string // the operation key's text
	table  string // the runner's table, as configured
	quoted string // the runner's table, quoted for PostgreSQL
	// name is the process lock's name (database file, table, key), set by
	// the first try.
	name string
}

// pgLockKey is the key's PostgreSQL advisory lock number: a 64-bit hash of
// the key ($1) seeded with the table's OID ($2, the quoted table name,
// resolved through the search_path), so Runners on different tables, or on
// tables of one name in different schemas, never wait for each other. Two
// keys of one table whose hashes collide only wait for each other.
const pgLockKey = `hashtextextended($1, $2::regclass::oid::bigint)`

// pgLocker: session-level advisory locks. Session-level, they survive the
// COMMIT of the begin transaction and are held through the external call,
// until unlock or the end of the session (a crashed process's connection
// closes and the server releases them). That is how a live holder is told
// from a dead one.
type pgLocker struct{}

func (pgLocker) session() bool { return true }

func (pgLocker) try(ctx context.Context, c conn, k *lockKey) (bool, error) {
	var got bool
	err := c.QueryRow(ctx, `SELECT pg_try_advisory_lock(`+pgLockKey+`)`, k.key, k.quoted).Scan(&got)
	return got, err
}

// wait: pg_advisory_lock bounded by lock_timeout, which set_config sets for
// one short transaction only (is_local); the lock outlives it. 55P03 is the
// timeout.
func (pgLocker) wait(ctx context.Context, c conn, k *lockKey, d time.Duration) (error, error) {
	t, err := c.begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = t.rollback(context.WithoutCancel(ctx)) }()
	ms := max(d.Milliseconds(), 1)
	if _, err := t.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", ms)); err != nil {
		return nil, err
	}
	if _, err := t.Exec(ctx, `SELECT pg_advisory_lock(`+pgLockKey+`)`, k.key, k.quoted); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			return err, nil
		}
		return nil, err
	}
	return nil, t.commit(ctx)
}

func (pgLocker) unlock(ctx context.Context, c conn, k *lockKey) (bool, error) {
	var held bool
	err := c.QueryRow(ctx, `SELECT pg_advisory_unlock(`+pgLockKey+`)`, k.key, k.quoted).Scan(&held)
	return held, err
}

// myLocker: MySQL/MariaDB user-level locks (GET_LOCK), which belong to the
// session like PostgreSQL's advisory locks and, like them, survive COMMIT.
// The name hashes the database, the table and the key (SHA1 keeps it within
// MySQL's 64 characters; names are compared case-insensitively, which hex
// digits survive). GET_LOCK's timeout is in whole seconds on MySQL: a wait
// is rounded up to the next second. The parts are hashed as bytes: as text,
// DATABASE() (utf8mb3) and a key with a 4-byte character (utf8mb4) cannot be
// concatenated (1271 illegal mix of collations), while the bytes of any
// other key, and so its lock name, are the same either way.
type myLocker struct{}

const myLockName = `CONCAT('idem-op:', SHA1(CONCAT(CAST(COALESCE(DATABASE(), '') AS BINARY), '.', CAST(? AS BINARY), ':', CAST(? AS BINARY))))`

func (myLocker) session() bool { return true }

func (myLocker) try(ctx context.Context, c conn, k *lockKey) (bool, error) {
	timedOut, err := myLocker{}.getLock(ctx, c, k, 0)
	return err == nil && timedOut == nil, err
}

func (myLocker) wait(ctx context.Context, c conn, k *lockKey, d time.Duration) (error, error) {
	return myLocker{}.getLock(ctx, c, k, max(int64(math.Ceil(d.Seconds())), 1))
}

func (myLocker) getLock(ctx context.Context, c conn, k *lockKey, seconds int64) (error, error) {
	var got *int64
	if err := c.QueryRow(ctx, `SELECT GET_LOCK(`+myLockName+`, ?)`, k.table, k.key, seconds).Scan(&got); err != nil {
		return nil, err
	}
	switch {
	case got == nil:
		return nil, errors.New("GET_LOCK returned NULL")
	case *got != 1:
		return fmt.Errorf("GET_LOCK: not granted within %ds", seconds), nil
	}
	return nil, nil
}

func (myLocker) unlock(ctx context.Context, c conn, k *lockKey) (bool, error) {
	var released *int64 // 1 released, 0 held by another session, NULL no such lock
	err := c.QueryRow(ctx, `SELECT RELEASE_LOCK(`+myLockName+`)`, k.table, k.key).Scan(&released)
	return released != nil && *released == 1, err
}

// processLocker: SQLite has no session locks, so the lock belongs to the
// process: a channel per (database file, table, key), the table named as
// SQLite identifies it (processLockTable). That makes the
// guarantee per process: two processes writing one SQLite file do not see
// each other's locks (see the package doc). A crashed process's locks go
// with it, as a crashed session's do.
type processLocker struct{}

func (processLocker) session() bool { return false }

// processLocks is the process's table of held or awaited key locks.
var processLocks = struct {
	mu sync.Mutex
	m  map[string]*processLock
}{m: map[string]*processLock{}}

// processLock is one key's lock: a token in ch means held.
type processLock struct {
	ch      chan struct{}
	refs    int // holders and waiters; the entry goes at 0
	waiters int
}

func acquireProcessLock(name string) *processLock {
	processLocks.mu.Lock()
	defer processLocks.mu.Unlock()
	l := processLocks.m[name]
	if l == nil {
		l = &processLock{ch: make(chan struct{}, 1)}
		processLocks.m[name] = l
	}
	l.refs++
	return l
}

func releaseProcessLock(name string) {
	processLocks.mu.Lock()
	defer processLocks.mu.Unlock()
	if l := processLocks.m[name]; l != nil {
		if l.refs--; l.refs == 0 {
			delete(processLocks.m, name)
		}
	}
}

func processLockName(file, table, key string) string {
	return file + "\x00" + table + "\x00" + key
}

// processLockTable is the table of a Runner's configured Table ("name" or
// "schema.name") as SQLite identifies it: the schema whose database file
// holds it ("main" for an unqualified name, where the migrations create it
// and SQLite finds it) and its name, both lower-cased (SQLite's names
// ignore ASCII case). Every spelling of one table gives one lock: named
// after the spelling, "operation" and "main.operation" (or "OPERATION")
// were two locks on one table, and a Runner took a key another one was
// calling with for a dead attempt's (SQLite has no lease) and called again.
func processLockTable(table string) (schema, name string) {
	table = strings.ToLower(table)
	if s, n, ok := strings.Cut(table, "."); ok {
		return s, n
	}
	return "main", table
}

func (processLocker) try(ctx context.Context, c conn, k *lockKey) (bool, error) {
	if k.name == "" {
		schema, table := processLockTable(k.table)
		var file string
		err := c.QueryRow(ctx, `SELECT file FROM pragma_database_list WHERE name = ?1 COLLATE NOCASE`, schema).Scan(&file)
		if errors.Is(err, sqldb.ErrNoRows) {
			err = fmt.Errorf("schema %q of table %s is not attached", schema, k.table)
		}
		if err != nil {
			return false, err
		}
		k.name = processLockName(file, table, k.key)
	}
	l := acquireProcessLock(k.name)
	select {
	case l.ch <- struct{}{}:
		return true, nil
	default:
		releaseProcessLock(k.name)
		return false, nil
	}
}

func (processLocker) wait(ctx context.Context, _ conn, k *lockKey, d time.Duration) (error, error) {
	l := acquireProcessLock(k.name)
	processLocks.mu.Lock()
	l.waiters++
	processLocks.mu.Unlock()
	defer func() {
		processLocks.mu.Lock()
		l.waiters--
		processLocks.mu.Unlock()
	}()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case l.ch <- struct{}{}:
		return nil, nil
	case <-timer.C:
		releaseProcessLock(k.name)
		return fmt.Errorf("in-process key lock not granted within %s", d), nil
	case <-ctx.Done():
		releaseProcessLock(k.name)
		return nil, ctx.Err()
	}
}

func (processLocker) unlock(_ context.Context, _ conn, k *lockKey) (bool, error) {
	processLocks.mu.Lock()
	l := processLocks.m[k.name]
	processLocks.mu.Unlock()
	if l == nil {
		return false, nil
	}
	select {
	case <-l.ch:
	default:
		return false, nil
	}
	releaseProcessLock(k.name)
	return true, nil
}

// processLockWaiters is the number of attempts waiting for a process lock
// (tests).
func processLockWaiters(name string) int {
	processLocks.mu.Lock()
	defer processLocks.mu.Unlock()
	if l := processLocks.m[name]; l != nil {
		return l.waiters
	}
	return 0
}
