package inbox_test

// The claim's mark (processedstore.ClaimMarkerIs) lets COMMIT go without the
// commit guard's statement: these tests try to fool it, by a handler's SQL
// and by an administrator's reload, and to move a claim out of the guard's
// sight by search_path.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
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

// A config reload that turns default_transaction_read_only on (ALTER
// SYSTEM … ; SELECT pg_reload_conf(): how a server is put in read-only mode
// before a cutover) while a handler runs makes the mark's undo unreported
// (the transaction reverts to the value the mark already has). A handler
// that then ends the transaction by SQL and goes on writing (ROLLBACK AND
// CHAIN keeps it read-write) is still caught: after a COMMIT that reported
// no undo, the claim row is read, and it is missing, so the attempt fails
// as handler_ended_tx and is never acked as processed; the redelivery
// applies the effect once. What the handler wrote after its own ROLLBACK
// AND CHAIN is committed in this case (COMMIT went alone): the documented
// limit of the mark. On a private server (ALTER SYSTEM).
func TestReadOnlyReloadDuringAHandlerStillCatchesItsRollbackAndChain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testenv.StartPostgres(t)
	schema := testenv.SchemaOn(t, pg.URL)
	admin := testenv.PoolAt(t, pg.URL, schema, 2)
	store, err := processedstore.NewStore(processedstore.Config{Table: schema + ".processed_event"}) // qualified: marked
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(admin)))
	_, err = admin.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)
	setReadOnly := func(on bool) {
		q := `ALTER SYSTEM SET default_transaction_read_only = on`
		if !on {
			q = `ALTER SYSTEM RESET default_transaction_read_only`
		}
		_, err := admin.Exec(ctx, q)
		require.NoError(t, err)
		_, err = admin.Exec(ctx, `SELECT pg_reload_conf()`)
		require.NoError(t, err)
		time.Sleep(300 * time.Millisecond) // the postmaster signals every backend
	}

	pool := testenv.PoolAt(t, pg.URL, schema, 1)
	b, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	var misuse bool
	var reported string
	h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'before')`, msg.UUID); err != nil {
			return nil, err
		}
		if !misuse {
			return nil, nil
		}
		setReadOnly(true) // the admin, at that moment
		if _, err := tx.Exec(msg.Context(), `ROLLBACK AND CHAIN`); err != nil {
			return nil, err
		}
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'after')`, msg.UUID)
		reported = tx.Conn().PgConn().ParameterStatus("default_transaction_read_only")
		return nil, err
	})
	_, err = h(newMsg(uuid.Must(uuid.NewV7()).String())) // a first, ordinary message
	require.NoError(t, err)

	id := uuid.Must(uuid.NewV7()).String()
	misuse = true
	_, err1 := h(newMsg(id))
	misuse = false
	setReadOnly(false) // the admin is done
	var claims, after int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_id = $1`, id).Scan(&claims))
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1 AND note = 'after'`, id).Scan(&after))
	t.Logf("attempt with ROLLBACK AND CHAIN: err=%v; marker as last reported=%q; claims=%d; 'after' rows=%d", err1, reported, claims, after)
	_, err2 := h(newMsg(id)) // the redelivery
	var effects int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1 AND note = 'before'`, id).Scan(&effects))
	assert.Equal(t, "handler_ended_tx", permanentReason(err1), "the handler's ROLLBACK AND CHAIN is caught")
	assert.Equal(t, "on", reported, "the mark's undo was not reported")
	assert.Zero(t, claims, "the claim was rolled back by the handler")
	assert.NoError(t, err2)
	assert.Equal(t, 1, effects, "the redelivery applies the effect once")
}
