// Rule tx-end: a handler ending the attempt's transaction.
package txend

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

func handle(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.PgxTxFromContext(ctx)
	if !ok {
		return nil
	}
	defer tx.Rollback(ctx) // want `idemvet: Rollback of the attempt's transaction: return nil or an error and let the middleware commit or roll back with the claim`
	if _, err := tx.Exec(ctx, "UPDATE stock SET n = n - 1"); err != nil {
		return err
	}
	tx.Exec(ctx, "COMMIT")                     // want `idemvet: Exec "COMMIT" ends the attempt's transaction`
	tx.Exec(ctx, " end;")                      // want `Exec "END" ends the attempt's transaction`
	tx.Exec(ctx, "abort")                      // want `Exec "ABORT" ends`
	tx.Exec(ctx, "ROLLBACK")                   // want `Exec "ROLLBACK" ends`
	tx.Exec(ctx, "ROLLBACK AND CHAIN")         // want `Exec "ROLLBACK" ends`
	tx.Exec(ctx, "UPDATE t SET a=1; COMMIT")   // want `Exec "COMMIT" ends`
	tx.Exec(ctx, "RELEASE SAVEPOINT sqlsub_1") // want `Exec "RELEASE SAVEPOINT" ends`
	tx.Exec(ctx, "PREPARE TRANSACTION 'x'")    // want `Exec "PREPARE TRANSACTION" ends`
	return tx.Commit(ctx)                      // want `idemvet: Commit of the attempt's transaction`
}

// The handler's own savepoints are its to release or roll back to; pgx's
// nested transaction (tx.Begin) is a savepoint too, so its Commit and
// Rollback are not reported.
func savepoints(msg *message.Message) error {
	ctx := msg.Context()
	tx, _ := middleware.PgxTxFromContext(ctx)
	tx.Exec(ctx, "SAVEPOINT before_stock")
	if _, err := tx.Exec(ctx, "UPDATE stock SET n = n - 1"); err != nil {
		tx.Exec(ctx, "ROLLBACK TO SAVEPOINT before_stock")
		tx.Exec(ctx, "rollback transaction to before_stock")
	}
	tx.Exec(ctx, "RELEASE SAVEPOINT before_stock")
	tx.Exec(ctx, "RELEASE before_stock")
	tx.Exec(ctx, "COMMENT ON TABLE t IS 'COMMIT'")

	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	defer sp.Rollback(ctx)
	if _, err := sp.Exec(ctx, "INSERT INTO audit VALUES (1)"); err != nil {
		return err
	}
	return sp.Commit(ctx)
}

// database/sql and the driver-neutral querier.
func handleSQL(msg *message.Message) error {
	ctx := msg.Context()
	tx, _ := middleware.SQLTxFromContext(ctx)
	tx.ExecContext(ctx, "COMMIT")         // want `idemvet: ExecContext "COMMIT" ends the attempt's transaction`
	if err := tx.Rollback(); err != nil { // want `Rollback of the attempt's transaction`
		return err
	}
	var q sqldb.Querier
	q, _ = middleware.QuerierFromContext(ctx)
	q.Exec(ctx, "ROLLBACK") // want `Exec "ROLLBACK" ends`
	q2, _ := sqldb.TxFromContext(ctx)
	q2.Exec(ctx, "COMMIT") // want `Exec "COMMIT" ends`
	return finish(ctx, tx)
}

// One level: a function of the package that receives the attempt's
// transaction.
func finish(ctx context.Context, tx *sql.Tx) error {
	return tx.Commit() // want `Commit of the attempt's transaction`
}

// A transaction the code began itself is its own to end.
func own(ctx context.Context, pool *pgxpool.Pool, db *sql.DB) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	tx.Exec(ctx, "COMMIT")
	stx, _ := db.BeginTx(ctx, nil)
	stx.Commit()
	return tx.Commit(ctx)
}
