package inbox_test

// The scan of the handler's statements (txscan.go) lets COMMIT go without
// the commit guard's statement: these tests try to fool it, by every route
// a handler has to the connection, and to move a claim out of the guard's
// sight by search_path.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// permanentReason is err's PermanentError reason, or "" (with err's
// text) when err is not one.
func permanentReason(err error) string {
	var p *inbox.PermanentError
	if errors.As(err, &p) {
		return p.Reason
	}
	return fmt.Sprintf("not permanent: %v", err)
}

// An unqualified claim table (no mark: only a qualified one is marked)
// whose consumer got its first message before the table existed (started
// before processed.Migrate: that claim fails with 42P01 and is retried):
// the guard's schema is not resolved while the table is missing, so once
// it exists the guard names the schema it was created in, and a claim that
// a handler's session-level SET search_path moved to another schema's
// same-named table is caught (handler_ended_tx): never applied twice.
func TestClaimMovedBySearchPathIsCaughtWhenTheTableCameAfterTheConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	other := testenv.Schema(t) // another tenant's schema, with a table of the same name
	// The other schema (another tenant, another service) has its own table.
	m1, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, m1.Migrate(ctx, sqldb.Pgx(testenv.PoolOn(t, other, 1))))
	_, err = admin.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)

	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	pool := testenv.PoolOn(t, schema, 1) // one connection: the redelivery runs where the SET stayed
	b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		q, _ := inbox.QuerierFromContext(msg.Context())
		if _, err := q.Exec(msg.Context(), `INSERT INTO `+schema+`.effect (event_id, note) VALUES ($1, 'x')`, msg.UUID); err != nil {
			return nil, err
		}
		_, err := q.Exec(msg.Context(), `SET search_path = `+other)
		return nil, err
	})

	// The first message arrives before the table is migrated: retried later.
	_, err = h(newMsg(uuid.Must(uuid.NewV7()).String()))
	require.Error(t, err, "no table yet")
	m2, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, m2.Migrate(ctx, sqldb.Pgx(admin)))

	id := uuid.Must(uuid.NewV7()).String()
	_, err = h(newMsg(id))
	require.NoError(t, err)
	_, err2 := h(newMsg(id)) // the redelivery, on the connection the SET stayed on
	var effects, moved int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.effect WHERE event_id = $1`, id).Scan(&effects))
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+other+`.processed_event`).Scan(&moved))
	assert.Zero(t, moved, "no claim committed in the other schema's table")
	assert.Equal(t, 1, effects, "the effect is applied once (redelivery: err=%v)", err2)
}

// A handler on the prepared claim over a qualified table (where COMMIT
// goes alone when every handler statement keeps the transaction) that
// ends the transaction and writes on in a new one by a route the text of
// one Exec does not show is still poisoned once (handler_ended_tx), what
// it wrote after its own BEGIN is not committed, and a redelivery applies
// its effect once: several statements in one simple-protocol query, a
// comment before COMMIT, a pgx.Batch, the connection itself (tx.Conn), a
// statement prepared under a name that reads as SELECT (in the same
// attempt, and in an earlier attempt on the same connection), and a query
// rewriter.
func TestHandlerEndingTheTransactionByAnyRouteIsCaughtWithoutTheGuardOnEveryCommit(t *testing.T) {
	t.Parallel()
	endingRoutesAreCaught(t, []endingRoute{
		{"one-query-string", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT 1; COMMIT; BEGIN", pgx.QueryExecModeSimpleProtocol)
			return err
		}},
		{"comment-first", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "/* done */ COMMIT AND CHAIN")
			return err
		}},
		{"batch", nil, func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue("SELECT 1")
			b.Queue("COMMIT")
			b.Queue("BEGIN")
			return tx.SendBatch(ctx, b).Close()
		}},
		{"conn", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Conn().Exec(ctx, "ROLLBACK AND CHAIN")
			return err
		}},
		{"prepared-as-select", nil, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Prepare(ctx, "select 1", "COMMIT AND CHAIN"); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "select 1")
			return err
		}},
		{"prepared-by-an-earlier-attempt", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Prepare(ctx, "select 2", "COMMIT AND CHAIN")
			return err
		}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "select 2")
			return err
		}},
		{"query-rewriter", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT 1", chainRewriter{})
			return err
		}},
	})
}

// endingRoute is a way for a handler to end the attempt's transaction and
// begin another.
type endingRoute struct {
	name string
	// earlier runs in a first attempt on the same connection, which
	// commits; end ends the second attempt's transaction and begins
	// another.
	earlier func(ctx context.Context, tx pgx.Tx) error
	end     func(ctx context.Context, tx pgx.Tx) error
}

// endingRoutesAreCaught checks, for each route, on the prepared claim over
// a qualified table, that the attempt whose handler took it is poisoned
// once (handler_ended_tx), that what the handler wrote after it is not
// committed, and that a redelivery applies the effect once.
func endingRoutesAreCaught(t *testing.T, routes []endingRoute) {
	t.Helper()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event", Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
	effect := schema + ".effect"
	_, err = admin.Exec(ctx, `CREATE TABLE `+effect+` (event_id uuid NOT NULL, part text NOT NULL)`)
	require.NoError(t, err)
	count := func(id, part string) (n int) {
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+effect+` WHERE event_id = $1 AND part = $2`, id, part).Scan(&n))
		return n
	}
	insert := `INSERT INTO ` + effect + ` (event_id, part) VALUES ($1, $2)`
	for _, r := range routes {
		t.Run(r.name, func(t *testing.T) {
			pool := testenv.PoolOn(t, schema, 1) // one connection: the earlier attempt's statements stay on it
			b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			poison := &capture{msgs: make(chan *message.Message, 4)}
			var step func(ctx context.Context, tx pgx.Tx) error
			calls := 0
			h := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				calls++
				ctx := msg.Context()
				tx, _ := inbox.PgxTxFromContext(ctx)
				if _, err := tx.Exec(ctx, insert, msg.UUID, "before"); err != nil {
					return nil, err
				}
				if step == nil {
					return nil, nil
				}
				if err := step(ctx, tx); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, insert, msg.UUID, "after")
				return nil, err
			})
			if r.earlier != nil {
				step = func(ctx context.Context, tx pgx.Tx) error {
					if err := r.earlier(ctx, tx); err != nil {
						return err
					}
					step = nil
					return nil
				}
				first := uuid.Must(uuid.NewV7()).String()
				_, err := h(newMsg(first))
				require.NoError(t, err)
				require.Empty(t, poison.msgs, "the earlier attempt ended nothing")
				require.Equal(t, 1, count(first, "after"))
			}
			step = r.end
			calls = 0
			id := uuid.Must(uuid.NewV7()).String()
			_, err = h(newMsg(id))
			require.NoError(t, err, "acked once poisoned")
			require.Equal(t, 1, calls, "permanent: poisoned at once, never retried")
			require.Len(t, poison.msgs, 1, "poisoned once")
			p := <-poison.msgs
			require.Equal(t, "permanent", p.Metadata.Get(inbox.MetadataPoisonClass))
			require.Zero(t, count(id, "after"), "what the handler wrote after its own BEGIN is not committed")
			step = nil
			for range 2 {
				_, err = h(newMsg(id))
				require.NoError(t, err)
			}
			require.Equal(t, 1, count(id, "before"), "the effect is applied once")
			require.Empty(t, poison.msgs)
		})
	}
}

// A handler that passes pgx.QueryExecModeSimpleProtocol with arguments
// has pgx send text the scan never saw: pgx's sanitizer writes each
// argument as a quoted literal into the query string, by a lexer of its
// own. Where it misreads a string (pgx v5.8 knew no dollar quotes; it
// takes name'\' for an E string), an argument PostgreSQL reads inside a
// string ends it, and what follows runs as statements of their own. Each
// route is first tried in a plain transaction with the pgx this test is
// built with: one that ends the transaction there is, in an attempt,
// poisoned once, with nothing written after it committed and the effect
// applied once; one that does not is harmless with this pgx (newer
// releases read dollar quotes), and the rule that sends the guard for
// every such call is checked by
// TestCommitGuardStatementRunsOnlyWhenAHandlerStatementMayEndTheTransaction.
func TestHandlerEndingTheTransactionThroughASimpleProtocolArgumentIsCaught(t *testing.T) {
	t.Parallel()
	const chain = "$q$; COMMIT AND CHAIN; SELECT $q$"
	const eChain = "; COMMIT AND CHAIN; SELECT "
	routes := []endingRoute{
		{"exec", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT $q$ $1 $q$", pgx.QueryExecModeSimpleProtocol, chain)
			return err
		}},
		{"rollback-and-begin", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT $q$ $1 $q$", pgx.QueryExecModeSimpleProtocol, "$q$; ROLLBACK; BEGIN; SELECT $q$")
			return err
		}},
		{"query-row", nil, func(ctx context.Context, tx pgx.Tx) error {
			var s string
			return tx.QueryRow(ctx, "SELECT $q$ $1 $q$", pgx.QueryExecModeSimpleProtocol, chain).Scan(&s)
		}},
		{"named-args", nil, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT $q$ @v $q$", pgx.QueryExecModeSimpleProtocol, pgx.NamedArgs{"v": chain})
			return err
		}},
		{"e-quote-after-an-identifier", nil, func(ctx context.Context, tx pgx.Tx) error {
			// pgx reads name'\' as E'\' (an escaped quote: the string
			// goes on), PostgreSQL as the type name and the string '\';
			// the newline continues it, so PostgreSQL reads $1 inside a
			// string, pgx outside, and the argument's quote ends it.
			_, err := tx.Exec(ctx, "SELECT name'\\'\n' $1 '", pgx.QueryExecModeSimpleProtocol, eChain)
			return err
		}},
	}
	ctx := context.Background()
	probe, _ := testenv.Pool(t)
	var ending []endingRoute
	for _, r := range routes {
		tx, err := probe.Begin(ctx)
		require.NoError(t, err)
		var before, after int64
		require.NoError(t, tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&before))
		routeErr := r.end(ctx, tx)
		if routeErr == nil {
			require.NoError(t, tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&after))
		}
		require.NoError(t, tx.Rollback(ctx))
		if routeErr == nil && after != before {
			ending = append(ending, r)
			continue
		}
		t.Logf("%s: this pgx keeps the argument inside the string (%v): harmless here", r.name, routeErr)
	}
	if len(ending) > 0 {
		endingRoutesAreCaught(t, ending)
	}
}

// pgx.Rows has Conn: a handler that reads rows reaches the connection
// without pgx.Tx.Conn, and what it sends there is not scanned. It is
// still caught, whether the rows came from Query, from a batch's results
// or to a batch's callback, and whether it ends the transaction at once
// or prepares, in an earlier attempt on the same connection, a statement
// whose name reads as SELECT.
func TestHandlerReachingTheConnectionThroughRowsIsCaught(t *testing.T) {
	t.Parallel()
	rowsConn := func(ctx context.Context, tx pgx.Tx) (*pgx.Conn, error) {
		rows, err := tx.Query(ctx, "SELECT 1")
		if err != nil {
			return nil, err
		}
		rows.Close()
		return rows.Conn(), rows.Err()
	}
	endingRoutesAreCaught(t, []endingRoute{
		{"query", nil, func(ctx context.Context, tx pgx.Tx) error {
			c, err := rowsConn(ctx, tx)
			if err != nil {
				return err
			}
			_, err = c.Exec(ctx, "COMMIT AND CHAIN")
			return err
		}},
		{"batch-results", nil, func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue("SELECT 1")
			br := tx.SendBatch(ctx, b)
			rows, err := br.Query()
			if err != nil {
				return err
			}
			rows.Close()
			c := rows.Conn()
			if err := br.Close(); err != nil {
				return err
			}
			_, err = c.Exec(ctx, "COMMIT AND CHAIN")
			return err
		}},
		{"batch-callback", nil, func(ctx context.Context, tx pgx.Tx) error {
			var c *pgx.Conn
			b := &pgx.Batch{}
			b.Queue("SELECT 1").Query(func(rows pgx.Rows) error {
				c = rows.Conn()
				return nil
			})
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			_, err := c.Exec(ctx, "COMMIT AND CHAIN")
			return err
		}},
		{"prepared-by-an-earlier-attempt", func(ctx context.Context, tx pgx.Tx) error {
			c, err := rowsConn(ctx, tx)
			if err != nil {
				return err
			}
			_, err = c.Prepare(ctx, "select 3", "COMMIT AND CHAIN")
			return err
		}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "select 3")
			return err
		}},
	})
}

// A query rewriter is given the connection (pgx.QueryRewriter's conn): a
// handler's own rewriter reaches it as tx.Conn does. One that prepares,
// in an earlier attempt on the same connection, a statement whose name
// reads as SELECT, by Exec or in a batch, is caught when a later
// attempt's plain-looking statement runs it.
func TestQueryRewriterReachingTheConnectionIsCaughtInLaterAttempts(t *testing.T) {
	t.Parallel()
	endingRoutesAreCaught(t, []endingRoute{
		{"exec", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT 1", preparingRewriter{name: "select 4"})
			return err
		}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "select 4")
			return err
		}},
		{"batch", func(ctx context.Context, tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue("SELECT 1", preparingRewriter{name: "select 5"})
			return tx.SendBatch(ctx, b).Close()
		}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "select 5")
			return err
		}},
	})
}

// preparingRewriter prepares COMMIT AND CHAIN under name on the
// connection it is given and leaves the query as it is.
type preparingRewriter struct{ name string }

func (r preparingRewriter) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	_, err := conn.Prepare(ctx, r.name, "COMMIT AND CHAIN")
	return sql, args, err
}

// chainRewriter is a handler's own pgx.QueryRewriter: pgx sends what it
// returns.
type chainRewriter struct{}

func (chainRewriter) RewriteQuery(ctx context.Context, conn *pgx.Conn, sql string, args []any) (string, []any, error) {
	return "COMMIT AND CHAIN", nil, nil
}

// pgx runs a prepared statement named by a query string in its place,
// also the "commit" and "rollback" pgx itself or this library sends
// through pgx.Conn (with a tracer on the pool, COMMIT goes through it).
// A handler that prepares a harmless statement under the name "commit"
// (its SQL keeps the transaction, so COMMIT still goes alone) makes that
// COMMIT run it instead: the attempt must then not be acked while its
// claim and its effects are rolled back with the connection; an attempt
// acked has its effect committed, once. With and without a tracer, on
// the pinned claim (COMMIT alone) and on an unqualified table (the guard
// statement with COMMIT).
func TestStatementPreparedAsCommitNeverAcksAnUncommittedAttempt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, schema := testenv.Pool(t)
	for _, c := range []struct {
		name      string
		traced    bool
		qualified bool
	}{{"traced-pinned", true, true}, {"traced-guarded", true, false}, {"untraced-pinned", false, true}, {"untraced-guarded", false, false}} {
		t.Run(c.name, func(t *testing.T) {
			table := "processed_" + strings.ReplaceAll(c.name, "-", "_")
			effect := schema + ".effect_" + strings.ReplaceAll(c.name, "-", "_")
			if c.qualified {
				table = schema + "." + table
			}
			store, err := processedstore.NewStore(processedstore.Config{Table: table, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
			_, err = admin.Exec(ctx, `CREATE TABLE `+effect+` (event_id uuid NOT NULL)`)
			require.NoError(t, err)
			cfg := testenv.PoolConfig(t, testenv.PostgresURL(), schema, 1)
			if c.traced {
				cfg.ConnConfig.Tracer = nopTracer{}
			}
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
			require.NoError(t, err)
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			poison := &capture{msgs: make(chan *message.Message, 8)}
			h := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				tx, _ := inbox.PgxTxFromContext(ctx)
				if _, err := tx.Exec(ctx, `INSERT INTO `+effect+` (event_id) VALUES ($1)`, msg.UUID); err != nil {
					return nil, err
				}
				_, err := tx.Prepare(ctx, "commit", "SELECT 1")
				return nil, err
			})
			id := uuid.Must(uuid.NewV7()).String()
			acked := false
			for range 3 {
				if _, err := h(newMsg(id)); err == nil {
					acked = true
					break
				}
			}
			var n int
			require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+effect+` WHERE event_id = $1`, id).Scan(&n))
			if acked && len(poison.msgs) == 0 {
				assert.Equal(t, 1, n, "acked: the effect is committed once")
			} else {
				assert.LessOrEqual(t, n, 1, "never applied twice")
			}
		})
	}
}

// nopTracer is a pool's pgx tracer that does nothing.
type nopTracer struct{}

func (nopTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (nopTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
