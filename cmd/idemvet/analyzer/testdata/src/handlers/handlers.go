// Which functions count as handlers: the argument of the consumer's
// AddConsumerHandler/AddHandler in its forms, and one level of the
// functions of the package they call with the message or its context.
package handlers

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

var pool *pgxpool.Pool

func wire(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pub message.Publisher, repo *repo) {
	c.AddConsumerHandler(r, "named", "t", sub, named)
	c.AddConsumerHandler(r, "var", "t", sub, packageVar)
	local := func(msg *message.Message) error {
		pool.Exec(msg.Context(), "DELETE FROM local") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
		return nil
	}
	c.AddConsumerHandler(r, "local", "t", sub, local)
	c.AddConsumerHandler(r, "factory", "t", sub, factory(pool))
	c.AddHandler(r, "conv", "t", sub, "u", pub, message.HandlerFunc(converted))
	c.AddConsumerHandler(r, "method", "t", sub, repo.handle)
}

func named(msg *message.Message) error {
	_, err := pool.Exec(msg.Context(), "DELETE FROM named") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return err
}

var packageVar = func(msg *message.Message) error {
	pool.Exec(msg.Context(), "DELETE FROM packagevar") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return nil
}

func factory(p *pgxpool.Pool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		p.Exec(msg.Context(), "DELETE FROM factory") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
		return nil
	}
}

func converted(msg *message.Message) ([]*message.Message, error) {
	pool.Exec(msg.Context(), "DELETE FROM converted") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return nil, nil
}

// The repository pattern: the handler calls methods of the package with
// its context; they are checked one level deep.
type repo struct {
	pool *pgxpool.Pool
}

func (r *repo) handle(msg *message.Message) error {
	ctx := msg.Context()
	if err := r.reserve(ctx, "o-1"); err != nil {
		return err
	}
	if err := r.save(ctx, "o-1"); err != nil {
		return err
	}
	r.noContext("o-1")
	return r.viaMessage(msg)
}

func (r *repo) reserve(ctx context.Context, id string) error {
	_, err := r.pool.Exec(ctx, "UPDATE stock SET n = n - 1 WHERE id = $1", id) // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	if err != nil {
		return err
	}
	return r.deeper(ctx, id)
}

// Two levels down: not followed.
func (r *repo) deeper(ctx context.Context, id string) error {
	_, err := r.pool.Exec(ctx, "DELETE FROM deeper")
	return err
}

// A querier that prefers the attempt's transaction is the right pattern.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgx.CommandTag, error)
}

func (r *repo) q(ctx context.Context) querier {
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		return tx
	}
	return r.pool
}

func (r *repo) save(ctx context.Context, id string) error {
	_, err := r.q(ctx).Exec(ctx, "INSERT INTO reservations VALUES ($1)", id)
	return err
}

// Neither the message nor a context: not followed.
func (r *repo) noContext(id string) {
	r.pool.Exec(context.Background(), "DELETE FROM nocontext")
}

func (r *repo) viaMessage(msg *message.Message) error {
	_, err := r.pool.Exec(context.Background(), "DELETE FROM viamessage") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return err
}

// A function of handler type that reads the attempt's transaction is a
// handler wherever it is attached (another package included).
func Reserve(msg *message.Message) error {
	tx, _ := middleware.PgxTxFromContext(msg.Context())
	tx.Exec(msg.Context(), "UPDATE stock SET n = n - 1")
	pool.Exec(msg.Context(), "INSERT INTO audit VALUES (1)") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return nil
}

// Paths that run only without an attempt's transaction (a handler that
// also works behind a plain router) are not in an attempt.
func Fallback(msg *message.Message) error {
	ctx := msg.Context()
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		_, err := tx.Exec(ctx, "INSERT INTO effect VALUES (1)")
		return err
	}
	_, err := pool.Exec(ctx, "INSERT INTO effect VALUES (1)")
	return err
}

func FallbackNot(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.PgxTxFromContext(ctx)
	if !ok {
		pool.Exec(ctx, "INSERT INTO effect VALUES (1)")
		return fallbackHelper(ctx)
	}
	if ok {
		tx.Exec(ctx, "INSERT INTO effect VALUES (1)")
	} else {
		pool.Exec(ctx, "INSERT INTO effect VALUES (1)")
	}
	pool.Exec(ctx, "INSERT INTO effect VALUES (2)") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return nil
}

func fallbackHelper(ctx context.Context) error {
	_, err := pool.Exec(ctx, "INSERT INTO effect VALUES (3)")
	return err
}

func Guarded(msg *message.Message) error {
	ctx := msg.Context()
	tx, ok := middleware.PgxTxFromContext(ctx)
	if !ok {
		return nil
	}
	tx.Exec(ctx, "INSERT INTO effect VALUES (1)")
	pool.Exec(ctx, "INSERT INTO effect VALUES (2)") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return nil
}
