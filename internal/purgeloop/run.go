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

// TxLockFunc takes a purger's lock inside the transaction open on q, as a
// transaction-scoped lock that the transaction's end releases
// (PostgreSQL pg_try_advisory_xact_lock): ok=false when another purger
// holds it.
type TxLockFunc func(ctx context.Context, q sqldb.Querier) (ok bool, err error)

// DrainTx is one purge run whose lock never outlives a transaction, for
// servers that may sit behind a pooler sharing server connections between
// clients (PgBouncer in transaction pooling), where a session-level lock
// leaks to the next client of the server connection and an unlock may run
// on another one. On a dedicated connection from pool, each batch is a
// transaction of its own that takes the lock first (BEGIN; lock; batch;
// COMMIT): ran=false at once when another purger holds it at the first
// batch; a run that finds it taken at a later batch stops there (the other
// purger goes on). So purgers of one table never work at the same moment,
// though two runs may take turns between batches. first (if set) runs
// once, after the lock was first granted, outside any transaction (its
// statements take the lock themselves where they need it). onPurge (if
// set) is called once per run that held the lock: in the last batch's
// transaction, before its COMMIT, while the lock is held (after the run
// when it stopped because another purger took the lock).
func DrainTx(ctx context.Context, pool sqldb.Pool, lock TxLockFunc, first func(ctx context.Context, q sqldb.Querier) error,
	batch BatchFunc, batchSize int, onPurge func(deleted int64, at time.Time)) (deleted int64, ran bool, err error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("acquire: %w", err)
	}
	defer conn.Release()
	called := false // onPurge
	rollback := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.Exec(rctx, "ROLLBACK")
	}
	for {
		if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
			return deleted, ran, fmt.Errorf("begin: %w", err)
		}
		ok, err := lock(ctx, conn)
		if err != nil {
			rollback()
			return deleted, ran, fmt.Errorf("lock: %w", err)
		}
		if !ok {
			rollback()
			break
		}
		if !ran {
			ran = true
			if first != nil {
				rollback() // ends the lock's transaction
				if err := first(ctx, conn); err != nil {
					return deleted, true, err
				}
				continue
			}
		}
		n, err := batch(ctx, conn, batchSize)
		deleted += n
		if err != nil {
			rollback()
			return deleted - n, true, err
		}
		last := n < int64(batchSize)
		if last && onPurge != nil {
			onPurge(deleted, time.Now()) // while the last batch holds the lock
			called = true
		}
		if _, err := conn.Exec(ctx, "COMMIT"); err != nil {
			rollback()
			return deleted - n, true, fmt.Errorf("commit: %w", err)
		}
		if last {
			break
		}
	}
	if ran && !called && onPurge != nil {
		onPurge(deleted, time.Now())
	}
	return deleted, ran, nil
}
