package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// sqlEnd is a handler's way of ending the attempt's transaction by SQL:
// the statements it sends, and whether the last one leaves it inside a new
// transaction (BEGIN, START TRANSACTION, AND CHAIN), where it goes on
// writing.
type sqlEnd struct {
	stmts    []string
	restarts bool
}

func (s sqlEnd) name() string { return strings.ReplaceAll(strings.Join(s.stmts, "+"), " ", "_") }

// sqlEndsOf lists the ways each dialect has.
func sqlEndsOf(d sqldb.Dialect) []sqlEnd {
	switch d {
	case sqldb.MySQL:
		return []sqlEnd{
			{[]string{"ROLLBACK"}, false},
			{[]string{"COMMIT"}, false},
			{[]string{"ROLLBACK", "BEGIN"}, true},
			{[]string{"COMMIT", "START TRANSACTION"}, true},
			{[]string{"COMMIT AND CHAIN"}, true},
			{[]string{"ROLLBACK AND CHAIN"}, true},
		}
	case sqldb.SQLite:
		return []sqlEnd{
			{[]string{"ROLLBACK"}, false},
			{[]string{"COMMIT"}, false},
			{[]string{"END"}, false},
			{[]string{"ROLLBACK", "BEGIN"}, true},
			{[]string{"COMMIT", "BEGIN"}, true},
		}
	}
	return []sqlEnd{
		{[]string{"ROLLBACK"}, false},
		{[]string{"COMMIT"}, false},
		{[]string{"END"}, false},
		{[]string{"ABORT"}, false},
		{[]string{"ROLLBACK", "BEGIN"}, true},
		{[]string{"COMMIT", "BEGIN"}, true},
		{[]string{"END", "BEGIN"}, true},
		{[]string{"COMMIT AND CHAIN"}, true},
		{[]string{"ROLLBACK AND CHAIN"}, true},
	}
}

// TestHandlerEndingOrRestartingTheTransactionBySQLIsPoisonedAndAppliedOnce
// (issue 27 item 4): on every beginner (pgx pipelined with the prepared
// claim and with a pgx.Batch claim, pgx's own transaction, database/sql on
// PostgreSQL, MariaDB and SQLite), a handler that ends the attempt's
// transaction by SQL (ROLLBACK, COMMIT, END, ABORT) or ends it and begins
// another (… then BEGIN or START TRANSACTION, COMMIT/ROLLBACK AND CHAIN) and
// writes on in it, then returns nil:
//   - is never acked as processed: the attempt is permanent
//     (handler_ended_tx), poisoned once at once, the handler called once
//     (never retried, never held in a loop);
//   - leaves nothing of what it wrote after its own BEGIN (the guard makes
//     the middleware's COMMIT roll that transaction back);
//   - and a redelivery of the event (a well-behaved handler) applies its
//     effect exactly once: again when the claim was rolled back, never when
//     the handler's COMMIT committed it with the effect.
//
// The connection the misuse ran on serves the redelivery (one connection).
func TestHandlerEndingOrRestartingTheTransactionBySQLIsPoisonedAndAppliedOnce(t *testing.T) {
	t.Parallel()
	type beginner struct {
		name   string
		target string
		build  func(t *testing.T, tg testenv.Target) inbox.TxBeginner
		// qualified: the table is named with its schema, as NewConsumer
		// names it, so the prepared claim marks its transaction and COMMIT
		// goes without the guard's statement while the mark stands.
		qualified bool
	}
	pgxOn := func(mode pgx.QueryExecMode, cfg inbox.PgxBeginnerConfig) func(*testing.T, testenv.Target) inbox.TxBeginner {
		return func(t *testing.T, tg testenv.Target) inbox.TxBeginner {
			pc := testenv.PoolConfig(t, testenv.PostgresURL(), tg.Database, 1)
			pc.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(context.Background(), pc)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			return mustBeginner(inbox.NewPgxBeginner(pool, cfg))
		}
	}
	std := func(t *testing.T, tg testenv.Target) inbox.TxBeginner {
		tg.Std.SetMaxOpenConns(1)
		return mustBeginner(inbox.NewStdBeginner(tg.Std))
	}
	beginners := []beginner{
		{"pgx-prepared", testenv.TargetPostgresPgx, pgxOn(pgx.QueryExecModeCacheStatement, inbox.PgxBeginnerConfig{}), false},
		{"pgx-prepared-marked", testenv.TargetPostgresPgx, pgxOn(pgx.QueryExecModeCacheStatement, inbox.PgxBeginnerConfig{}), true},
		{"pgx-batch-simple", testenv.TargetPostgresPgx, pgxOn(pgx.QueryExecModeSimpleProtocol, inbox.PgxBeginnerConfig{}), false},
		{"pgx-batch-exec", testenv.TargetPostgresPgx, pgxOn(pgx.QueryExecModeExec, inbox.PgxBeginnerConfig{}), false},
		{"pgx-native", testenv.TargetPostgresPgx, pgxOn(pgx.QueryExecModeCacheStatement, inbox.PgxBeginnerConfig{DisablePipeline: true}), false},
		{"database-sql-postgres", testenv.TargetPostgresStdlib, std, false},
		{"database-sql-mariadb", testenv.TargetMariaDB, std, false},
		{"database-sql-sqlite", testenv.TargetSQLite, std, false},
	}
	for _, bg := range beginners {
		t.Run(bg.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tg := testenv.NewTarget(t, bg.target, 2)
			table := ""
			if bg.qualified {
				table = tg.Database + ".processed_event"
			}
			store, err := processedstore.NewStore(processedstore.Config{Table: table, Dialect: tg.Dialect, Horizon: time.Hour})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx, tg.DB))
			_, err = tg.DB.Exec(ctx, `CREATE TABLE effect (event_id VARCHAR(36) NOT NULL, part VARCHAR(10) NOT NULL)`)
			require.NoError(t, err)
			b := bg.build(t, tg)
			count := func(id, part string) int {
				var n int
				require.NoError(t, tg.DB.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = '`+id+`' AND part = '`+part+`'`).Scan(&n))
				return n
			}
			write := func(msg *message.Message, part string) error {
				q, ok := inbox.QuerierFromContext(msg.Context())
				require.True(t, ok)
				_, err := q.Exec(msg.Context(), `INSERT INTO effect (event_id, part) VALUES ('`+msg.UUID+`', '`+part+`')`)
				return err
			}
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
			require.NoError(t, err)
			for _, end := range sqlEndsOf(tg.Dialect) {
				t.Run(end.name(), func(t *testing.T) {
					poison := &capture{msgs: make(chan *message.Message, 4)}
					calls := 0
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					misuse := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
						calls++
						if calls > 5 { // retried or held in a loop: end it, the test fails below
							cancel()
							return nil, context.Canceled
						}
						if err := write(msg, "before"); err != nil {
							return nil, err
						}
						q, _ := inbox.QuerierFromContext(msg.Context())
						for _, s := range end.stmts {
							if _, err := q.Exec(msg.Context(), s); err != nil {
								return nil, err
							}
						}
						if end.restarts {
							if err := write(msg, "after"); err != nil {
								return nil, err
							}
						}
						return nil, nil
					})
					id := uuid.Must(uuid.NewV7()).String()
					msg := newMsg(id)
					msg.SetContext(ctx)
					_, err := misuse(msg)
					require.NoError(t, err, "acked once poisoned")
					require.Equal(t, 1, calls, "permanent: poisoned at once, never retried")
					require.Len(t, poison.msgs, 1, "poisoned once")
					p := <-poison.msgs
					require.Equal(t, "permanent", p.Metadata.Get(inbox.MetadataPoisonClass))
					require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "ended the attempt's transaction")
					require.Zero(t, count(id, "after"), "what the handler wrote after its own BEGIN is not committed")

					// Redelivered (a replay of the poisoned message), to a
					// handler that behaves: its effect is applied once.
					good := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
						return nil, write(msg, "before")
					})
					for range 2 {
						_, err = good(newMsg(id))
						require.NoError(t, err)
					}
					require.Equal(t, 1, count(id, "before"), "the effect is applied once")
					require.Zero(t, count(id, "after"))
					ok, err := store.Processed(ctx, tg.DB, "stock", uuid.MustParse(id))
					require.NoError(t, err)
					require.True(t, ok, "claimed")
					require.Empty(t, poison.msgs)
				})
			}
		})
	}
}
