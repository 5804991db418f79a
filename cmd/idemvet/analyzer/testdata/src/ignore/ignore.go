// //idemvet:ignore <reason> silences its line.
package ignore

import (
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

func wire(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pool *pgxpool.Pool) {
	c.AddConsumerHandler(r, "h", "t", sub, func(msg *message.Message) error {
		ctx := msg.Context()
		pool.Exec(ctx, "INSERT INTO audit VALUES (1)") //idemvet:ignore the audit row must survive a rollback
		// idemvet:ignore a metrics table, lossy by design
		pool.Exec(ctx, "UPDATE counters SET n = n + 1")
		//idemvet:ignore multi-line call, directive on the line above
		pool.Exec(ctx,
			"UPDATE counters SET n = n + 1")
		pool.Exec(ctx,
			"UPDATE counters SET n = n + 1") //idemvet:ignore directive on the last line of the call
		http.Get("https://status.example/") //idemvet:ignore a status ping, repeating it is harmless

		pool.Exec(ctx, "DELETE FROM t") /* want `write through \*pgxpool.Pool` `idemvet: //idemvet:ignore needs a reason` */ //idemvet:ignore
		pool.Exec(ctx, "DELETE FROM t") //idemvet:ignore a trailing directive covers its own line only
		pool.Exec(ctx, "DELETE FROM t") // want `write through \*pgxpool.Pool`
		//idemvet:ignore a directive alone on its line covers the next line only

		pool.Exec(ctx, "DELETE FROM t") // want `write through \*pgxpool.Pool`

		pool.Exec(ctx, "DELETE FROM t") //idemvet:ignoreall is not the directive // want `write through \*pgxpool.Pool`
		return nil
	})
}

// The directive works for every rule.
func endsOnPurpose(msg *message.Message) error {
	var tx, _ = middleware.PgxTxFromContext(msg.Context())
	tx.Exec(msg.Context(), "COMMIT")  // want `Exec "COMMIT" ends the attempt's transaction`
	return tx.Rollback(msg.Context()) //idemvet:ignore this test handler fails the attempt on purpose
}
