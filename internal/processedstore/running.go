package processedstore

import (
	"context"
	"errors"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// StartRunning writes, in the transaction q is in, a row of <table>_running
// (migration 0009; 0005 of the partitioned layout), whose deferred foreign
// key idempotency_attempt_running fails the transaction's COMMIT (23503)
// until EndRunning deletes it, and returns its id;
// 0 and nothing written on MySQL and SQLite, which defer no constraint
// (ConsumerConfig.JoinSQLSubscriber is PostgreSQL only).
func (s *Store) StartRunning(ctx context.Context, q sqldb.Querier) (int64, error) {
	if s.dialect != sqldb.PostgreSQL {
		return 0, nil
	}
	var id int64
	err := q.QueryRow(ctx, "INSERT INTO "+s.sideTable("_running")+" (running) VALUES (-1) RETURNING attempt").Scan(&id)
	return id, err
}

// EndRunning deletes row id written by StartRunning and reports whether
// it was there: it is not once the transaction that wrote it ended (a
// COMMIT failed on it, a ROLLBACK) or was rolled back to a savepoint set
// before it.
func (s *Store) EndRunning(ctx context.Context, q sqldb.Querier, id int64) (bool, error) {
	n, err := q.Exec(ctx, "DELETE FROM "+s.sideTable("_running")+" WHERE attempt = $1", id)
	return n == 1, err
}

// Running reports whether row id written by StartRunning is still there
// (see EndRunning), leaving it.
func (s *Store) Running(ctx context.Context, q sqldb.Querier, id int64) (bool, error) {
	var one int
	err := q.QueryRow(ctx, "SELECT 1 FROM "+s.sideTable("_running")+" WHERE attempt = $1", id).Scan(&one)
	if errors.Is(err, sqldb.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}
