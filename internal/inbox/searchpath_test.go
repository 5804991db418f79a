package inbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// A handler that changes search_path for the session (SET, not SET LOCAL)
// leaves it on the pooled connection (processedstore.Config.Table's doc, README
// § Configuration reference). With a schema-qualified Table the redelivery
// on that connection still finds the claim: a duplicate, the effect once.
// With an unqualified Table the next claim on that connection goes to the
// other schema's table, as documented; the commit guard (issue 27 item 4)
// still looks for it in the table the connection's search_path named
// first, misses it and fails that attempt as permanent (handler_ended_tx),
// so the redelivery is not applied twice. A handler that sets search_path
// with SET LOCAL (the schema-per-tenant pattern) moves nothing: the
// guard finds the claim in the table it was made in, the redelivery is a
// duplicate.
func TestSessionSearchPathSetByHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	other := testenv.Schema(t) // another tenant's schema, with a table of the same name
	unqualified, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	otherPool, err := pgxpool.NewWithConfig(ctx, testenv.PoolConfig(t, testenv.PostgresURL(), other, 1))
	require.NoError(t, err)
	t.Cleanup(otherPool.Close)
	require.NoError(t, unqualified.Migrate(ctx, sqldb.Pgx(otherPool)))
	qualified, err := processedstore.NewStore(processedstore.Config{Table: e.schema + ".processed_event"})
	require.NoError(t, err)

	for _, c := range []struct {
		name    string
		store   *processedstore.Store
		set     string
		effects int
	}{{"qualified", qualified, "SET", 1}, {"unqualified", unqualified, "SET", 1}, {"unqualified-set-local", unqualified, "SET LOCAL", 1}} {
		t.Run(c.name, func(t *testing.T) {
			// One connection: the redelivery runs where the handler's SET stayed.
			pool, err := pgxpool.NewWithConfig(ctx, testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 1))
			require.NoError(t, err)
			defer pool.Close()
			h := e.mw(pool, func(cfg *inbox.Config) { cfg.Store = c.store; cfg.Consumer = "sp-" + c.name })(
				func(msg *message.Message) ([]*message.Message, error) {
					q, _ := inbox.QuerierFromContext(msg.Context())
					if _, err := q.Exec(msg.Context(), `INSERT INTO `+e.schema+`.effect (event_id, note) VALUES ($1, 'x')`, msg.UUID); err != nil {
						return nil, err
					}
					_, err := q.Exec(msg.Context(), c.set+` search_path = `+other)
					return nil, err
				})
			id := uuid.Must(uuid.NewV7()).String()
			for i := 0; i < 2; i++ {
				_, err := h(newMsg(id))
				if c.name == "unqualified" && i == 1 {
					var p *inbox.PermanentError
					require.ErrorAs(t, err, &p, "the claim moved to the other schema's table")
					require.Equal(t, "handler_ended_tx", p.Reason)
					continue
				}
				require.NoError(t, err)
			}
			require.Equal(t, c.effects, e.effects(id))
		})
	}
}

// A claim that is not prepared (a pool in the simple protocol: the
// pgx.Batch path, no marker) follows the connection's search_path at each
// statement: after a handler's session-level SET search_path the next claim
// on that connection goes to the other schema's table. The commit guard
// still looks in the table the search_path named first, misses the claim
// and fails that attempt as permanent (handler_ended_tx), so the
// redelivery is never applied twice.
func TestSessionSearchPathMovesAnUnpreparedClaimIntoTheGuard(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	other := testenv.Schema(t) // another tenant's schema, with a table of the same name
	require.NoError(t, e.store.Migrate(ctx, sqldb.Pgx(testenv.PoolOn(t, other, 1))))
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 1)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	h := e.mw(pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		q, _ := inbox.QuerierFromContext(msg.Context())
		if _, err := q.Exec(msg.Context(), `INSERT INTO `+e.schema+`.effect (event_id, note) VALUES ($1, 'x')`, msg.UUID); err != nil {
			return nil, err
		}
		_, err := q.Exec(msg.Context(), `SET search_path = `+other)
		return nil, err
	})
	id := uuid.Must(uuid.NewV7()).String()
	_, err = h(newMsg(id))
	require.NoError(t, err)
	_, err = h(newMsg(id))
	var p *inbox.PermanentError
	require.ErrorAs(t, err, &p, "the claim moved to the other schema's table")
	require.Equal(t, "handler_ended_tx", p.Reason)
	require.Equal(t, 1, e.effects(id))
}
