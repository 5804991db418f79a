// Package sqlitefile keeps, per process, which SQLite database files the
// idempotent middleware's transactions write to and which ones an
// operation.Runner records its operations in, so that the wiring that cannot
// work (one file for both: SQLite has one writer per file, and the Runner
// must commit its started record while the handler's transaction holds the
// file's write lock) is refused when the second of the two is constructed.
package sqlitefile

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
	"weak"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Role is what a registered handle uses its file for.
type Role int

const (
	// Inbox: the idempotent middleware's attempts (claim and effects).
	Inbox Role = iota + 1
	// Operations: an operation.Runner's records.
	Operations
)

// MainFileQuery is the path of the connection's main database file (""
// for an in-memory or temporary database).
const MainFileQuery = `SELECT file FROM pragma_database_list WHERE name = 'main'`

type entry struct {
	path string
	role Role
	db   weak.Pointer[sql.DB] // an entry dies with its handle
}

var (
	mu      sync.Mutex
	entries []entry
)

// Conflict is the refusal of Register: Path is registered under Other by a
// live handle. It wraps sqldb.ErrSharedSQLiteFile.
type Conflict struct {
	Path  string
	Other Role
}

// Error names the file.
func (c *Conflict) Error() string {
	return fmt.Sprintf("%s: %s", sqldb.ErrSharedSQLiteFile, c.Path)
}

// Unwrap returns sqldb.ErrSharedSQLiteFile.
func (c *Conflict) Unwrap() error { return sqldb.ErrSharedSQLiteFile }

// Register reads db's main database file (one query, bounded by 10 s) and
// records it under role. It returns the file's path ("" for an in-memory
// database, which is never shared and not recorded), a *Conflict when a
// live handle registered the same file (same inode, whatever the path
// spelling or symlink) under the other role, or the query's error.
func Register(db *sql.DB, role Role) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var path string
	if err := db.QueryRowContext(ctx, MainFileQuery).Scan(&path); err != nil {
		return "", fmt.Errorf("read the SQLite database file: %w", err)
	}
	if path == "" {
		return "", nil
	}
	e := entry{path: filepath.Clean(path), role: role, db: weak.Make(db)}
	info, _ := os.Stat(e.path)
	mu.Lock()
	defer mu.Unlock()
	live := entries[:0]
	var conflict *Conflict
	for _, o := range entries {
		if o.db.Value() == nil {
			continue // the handle was garbage collected
		}
		live = append(live, o)
		if o.role != role && conflict == nil && same(o.path, e.path, info) {
			conflict = &Conflict{Path: e.path, Other: o.role}
		}
	}
	entries = live
	if conflict != nil {
		return e.path, conflict
	}
	entries = append(entries, e)
	return e.path, nil
}

// same reports whether the registered path a is, now, the file b (whose
// FileInfo is info, nil if it could not be stat'ed): by inode, so that
// another spelling or a symlink of one file is the same file, with a stat
// of a taken now, so that an inode freed by a deleted file and reused by
// another one is not.
func same(a, b string, info os.FileInfo) bool {
	if a == b {
		return true
	}
	if info == nil {
		return false
	}
	ai, err := os.Stat(a)
	return err == nil && os.SameFile(ai, info)
}
