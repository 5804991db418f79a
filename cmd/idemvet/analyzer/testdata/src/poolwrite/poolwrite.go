// Rule pool-write: statements through a pool or a connection in a handler
// attached behind the consumer's middleware.
package poolwrite

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

type service struct {
	pool *pgxpool.Pool
	db   *sql.DB
	conn *pgx.Conn
}

// embedded: the methods of an embedded pool are the pool's.
type store struct{ *pgxpool.Pool }

const insertReservation = "INSERT INTO reservations (order_id) VALUES ($1)"

func register(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pub message.Publisher,
	s *service, st store) {
	c.AddConsumerHandler(r, "reserve", "order.placed", sub, func(msg *message.Message) error {
		ctx := msg.Context()
		s.pool.Exec(ctx, "UPDATE stock SET n = n - 1")                // want `idemvet: write through \*pgxpool.Pool in a handler \(Exec\): use the attempt's transaction \(middleware.PgxTxFromContext\) so the effect commits with the claim`
		s.pool.SendBatch(ctx, &pgx.Batch{})                           // want `write through \*pgxpool.Pool in a handler \(SendBatch\)`
		s.pool.CopyFrom(ctx, pgx.Identifier{"t"}, []string{"a"}, nil) // want `write through \*pgxpool.Pool in a handler \(CopyFrom\)`
		tx, _ := s.pool.Begin(ctx)                                    // want `idemvet: transaction of its own on \*pgxpool.Pool in a handler \(Begin\)`
		_ = tx
		s.pool.BeginTx(ctx, pgx.TxOptions{})                                                             // want `transaction of its own on \*pgxpool.Pool in a handler \(BeginTx\)`
		s.pool.QueryRow(ctx, insertReservation+" RETURNING id")                                          // want `write through \*pgxpool.Pool in a handler \(QueryRow of a writing statement\)`
		s.pool.Query(ctx, "  -- a comment\n  /* another */ delete from t")                               // want `\(Query of a writing statement\)`
		s.pool.Query(ctx, "WITH moved AS (DELETE FROM a RETURNING *) INSERT INTO b SELECT * FROM moved") // want `\(Query of a writing statement\)`
		s.pool.Query(ctx, "MERGE INTO t USING s ON t.id = s.id WHEN MATCHED THEN DELETE")                // want `\(Query of a writing statement\)`
		s.db.ExecContext(ctx, "DELETE FROM t")                                                           // want `write through \*sql.DB in a handler \(ExecContext\): use the attempt's transaction \(middleware.SQLTxFromContext\)`
		s.db.Exec("DELETE FROM t")                                                                       // want `write through \*sql.DB in a handler \(Exec\)`
		s.db.Begin()                                                                                     // want `transaction of its own on \*sql.DB in a handler \(Begin\)`
		s.db.QueryRowContext(ctx, "insert into t values (1) returning id")                               // want `\*sql.DB in a handler \(QueryRowContext of a writing statement\)`
		s.conn.Exec(ctx, "UPDATE t SET a = 1")                                                           // want `write through \*pgx.Conn in a handler \(Exec\)`
		if c, err := s.db.Conn(ctx); err == nil {
			c.ExecContext(ctx, "UPDATE t SET a = 1") // want `write through \*sql.Conn in a handler \(ExecContext\)`
		}
		pc, _ := s.pool.Acquire(ctx)
		pc.Exec(ctx, "UPDATE t SET a = 1")                                               // want `write through \*pgxpool.Conn in a handler \(Exec\)`
		st.Exec(ctx, "UPDATE t SET a = 1")                                               // want `write through \*pgxpool.Pool in a handler \(Exec\)`
		pgx.BeginFunc(ctx, s.pool, func(pgx.Tx) error { return nil })                    // want `transaction of its own on \*pgxpool.Pool in a handler \(pgx.BeginFunc\)`
		pgx.BeginTxFunc(ctx, s.conn, pgx.TxOptions{}, func(pgx.Tx) error { return nil }) // want `transaction of its own on \*pgx.Conn in a handler \(pgx.BeginTxFunc\)`
		go func() {
			s.pool.Exec(context.Background(), "DELETE FROM t") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
		}()

		// Reads through the pool are outside the attempt too, but they are
		// not reported: only a statement that writes is.
		s.pool.Query(ctx, "SELECT n FROM stock")
		s.pool.QueryRow(ctx, "select n from stock where id = $1 for update")
		s.pool.Query(ctx, "WITH x AS (SELECT id FROM t FOR NO KEY UPDATE) SELECT * FROM x")
		s.pool.Query(ctx, "SELECT 'INSERT INTO t' AS text, \"update\" FROM t")
		s.db.QueryContext(ctx, "SELECT $$DELETE$$")
		q := "INSERT INTO t VALUES (1)"
		s.pool.Query(ctx, q) // not a constant: not classified, not reported

		// The attempt's transaction is the right handle.
		if tx, ok := middleware.PgxTxFromContext(ctx); ok {
			tx.Exec(ctx, "UPDATE stock SET n = n - 1")
			tx.QueryRow(ctx, insertReservation)
			tx.SendBatch(ctx, &pgx.Batch{})
			sp, _ := tx.Begin(ctx)
			_ = sp
		}
		if tx, ok := middleware.SQLTxFromContext(ctx); ok {
			tx.ExecContext(ctx, "UPDATE stock SET n = n - 1")
		}
		return nil
	})

	c.AddHandler(r, "forward", "order.placed", sub, "order.forwarded", pub, func(msg *message.Message) ([]*message.Message, error) {
		s.pool.Exec(msg.Context(), "INSERT INTO forwarded VALUES (1)") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
		return nil, nil
	})
}

// Pool use outside handlers is not reported: a migration, a purge, a
// read model refresh, a producer's own transaction.
func migrate(ctx context.Context, pool *pgxpool.Pool, db *sql.DB) error {
	if _, err := pool.Exec(ctx, "CREATE TABLE t (a int)"); err != nil {
		return err
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	tx.Exec(ctx, "INSERT INTO t VALUES (1)")
	_, err = db.Exec("DELETE FROM t")
	return tx.Commit(ctx)
}

// A handler attached to a plain router (not through the consumer) is not
// checked: only the consumer's handlers run in an attempt's transaction.
func plain(pool *pgxpool.Pool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		_, err := pool.Exec(msg.Context(), "DELETE FROM t")
		return err
	}
}
