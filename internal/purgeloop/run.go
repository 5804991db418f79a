package purgeloop

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// LockFunc takes a purger's lock for one run on conn: ok=false when another
// purger holds it. unlock releases it (call it once, on conn).
type LockFunc func(ctx context.Context, conn sqldb.Conn) (unlock func(), ok bool, err error)

// BatchFunc deletes at most limit rows on q and returns how many it deleted.
type BatchFunc func(ctx context.Context, q sqldb.Querier, limit int) (int64, error)

// Drain is one purge run: acquire a dedicated connection from pool, take the
// lock on it (or return ran=false at once), run batches until one comes back
// short, call onPurge (if set) while the lock is still held, release.
func Drain(ctx context.Context, pool sqldb.Pool, lock LockFunc, batch BatchFunc, batchSize int,
	onPurge func(deleted int64, at time.Time)) (deleted int64, ran bool, err error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	unlock, locked, err := lock(ctx, conn)
	if err != nil {
		return 0, false, fmt.Errorf("lock: %w", err)
	}
	if !locked {
		return 0, false, nil
	}
	defer unlock()
	for {
		n, err := batch(ctx, conn, batchSize)
		deleted += n
		if err != nil {
			return deleted, true, err
		}
		if n < int64(batchSize) {
			break
		}
	}
	if onPurge != nil {
		onPurge(deleted, time.Now())
	}
	return deleted, true, nil
}

// processLocks stand in for session locks on SQLite (one database file,
// normally one process).
var processLocks sync.Map // file + "\x00" + name → *sync.Mutex

// SQLiteProcessLock is the LockFunc for SQLite: a lock of this process per
// database file (read from conn) and name.
func SQLiteProcessLock(name string) LockFunc {
	return func(ctx context.Context, conn sqldb.Conn) (func(), bool, error) {
		var file string
		if err := conn.QueryRow(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file); err != nil {
			return nil, false, err
		}
		m, _ := processLocks.LoadOrStore(file+"\x00"+name, &sync.Mutex{})
		mu := m.(*sync.Mutex)
		if !mu.TryLock() {
			return nil, false, nil
		}
		return mu.Unlock, true, nil
	}
}
