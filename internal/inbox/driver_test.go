package inbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The database/sql driver gives the same contract: claim, duplicate, rollback.
func TestStdBeginnerContract(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	db, err := sql.Open("pgx", testenv.SchemaURL(e.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	var calls atomic.Int32
	m, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewStdBeginner(db)),
		Store:    e.store,
		Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		tx, ok := inbox.SQLTxFromContext(msg.Context())
		require.True(t, ok)
		_, ok = inbox.PgxTxFromContext(msg.Context())
		require.False(t, ok)
		if _, err := tx.ExecContext(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if n == 1 {
			return nil, errors.New("first fails")
		}
		return nil, nil
	})
	_, err = h(newMsg(E1))
	require.Error(t, err)
	for i := 0; i < 3; i++ {
		_, err = h(newMsg(E1))
		require.NoError(t, err)
	}
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 0, db.Stats().InUse)
}

// The unpipelined pgx beginner hands out pgx's own transaction.
func TestPgxUnpipelinedContract(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.Beginner = mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{DisablePipeline: true}))
	})(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		require.NoError(t, writeEffect(msg, "x"))
		if n == 1 {
			return nil, errors.New("first fails")
		}
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.Error(t, err)
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, e.effects(E1))
	require.EqualValues(t, 0, e.pool.Stat().AcquiredConns())
}

// The pipelined pgx.Tx: savepoints, batches, CopyFrom, Prepare and large
// objects all run inside the attempt's transaction.
func TestPipelinedTxImplementsPgxTx(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var oid uint32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, ok := inbox.PgxTxFromContext(ctx)
		require.True(t, ok)

		// Savepoint rolled back: its write vanishes, the outer tx goes on.
		sp, err := tx.Begin(ctx)
		require.NoError(t, err)
		_, err = sp.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'rolled back')`, msg.UUID)
		require.NoError(t, err)
		require.NoError(t, sp.Rollback(ctx))
		require.ErrorIs(t, sp.Commit(ctx), pgx.ErrTxClosed)
		// Savepoint released: its write stays.
		sp, err = tx.Begin(ctx)
		require.NoError(t, err)
		_, err = sp.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'savepoint')`, msg.UUID)
		require.NoError(t, err)
		require.NoError(t, sp.Commit(ctx))

		b := &pgx.Batch{}
		b.Queue(`INSERT INTO effect (event_id, note) VALUES ($1, 'batch')`, msg.UUID)
		require.NoError(t, tx.SendBatch(ctx, b).Close())

		n, err := tx.CopyFrom(ctx, pgx.Identifier{"effect"}, []string{"event_id", "note"},
			pgx.CopyFromRows([][]any{{msg.UUID, "copy"}}))
		require.NoError(t, err)
		require.EqualValues(t, 1, n)

		_, err = tx.Prepare(ctx, "count_effects", `SELECT count(*) FROM effect WHERE event_id = $1`)
		require.NoError(t, err)
		var cnt int
		require.NoError(t, tx.QueryRow(ctx, "count_effects", msg.UUID).Scan(&cnt))
		require.Equal(t, 3, cnt)

		rows, err := tx.Query(ctx, `SELECT note FROM effect WHERE event_id = $1 ORDER BY id`, msg.UUID)
		require.NoError(t, err)
		notes, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Equal(t, []string{"savepoint", "batch", "copy"}, notes)
		require.NotNil(t, tx.Conn())

		// Large objects (see pgxTx's documentation): created inside the
		// attempt's transaction, so they commit or vanish with it.
		lo := tx.LargeObjects()
		oid, err = lo.Create(ctx, 0)
		require.NoError(t, err)
		obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeWrite)
		require.NoError(t, err)
		_, err = obj.Write([]byte("hello"))
		require.NoError(t, err)
		require.NoError(t, obj.Close())
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 3, e.effects(E1))

	// The large object committed with the attempt.
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	lo := tx.LargeObjects()
	obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeRead)
	require.NoError(t, err)
	buf := make([]byte, 5)
	_, err = obj.Read(buf)
	require.NoError(t, err)
	require.True(t, bytes.Equal([]byte("hello"), buf))
}

// Two handlers of one service receive the same event through a real Watermill
// router, each with its own consumer name: each applies it once.
func TestTwoHandlersOfOneServiceEachApplyOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	require.NoError(t, err)
	var mu sync.Mutex
	calls := map[string]int{}
	for _, name := range []string{"reserve_stock", "notify_warehouse"} {
		m, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
			Store:    e.store,
			Consumer: name,
		}, logger)
		require.NoError(t, err)
		h := router.AddConsumerHandler(name, "orders", pubsub, func(msg *message.Message) error {
			mu.Lock()
			calls[name]++
			mu.Unlock()
			return writeEffect(msg, name)
		})
		h.AddMiddleware(m.Middleware)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	for i := 0; i < 3; i++ { // the same event three times
		require.NoError(t, pubsub.Publish("orders", newMsg(E1)))
	}
	require.Eventually(t, func() bool { return e.processed(E1) == 2 }, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, router.Close())
	require.Equal(t, 1, e.count(`SELECT count(*) FROM effect WHERE note = 'reserve_stock'`))
	require.Equal(t, 1, e.count(`SELECT count(*) FROM effect WHERE note = 'notify_warehouse'`))
	require.Equal(t, 2, e.count(`SELECT count(DISTINCT consumer) FROM processed_event`))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]int{"reserve_stock": 1, "notify_warehouse": 1}, calls)
}

// TestConsumerRequired (D14): Config.Consumer has no default (a handler-name
// default applied events twice when two processes of one consumer named their
// handlers differently); empty and blank names are refused at construction,
// naming the field, and never reach a claim.
func TestConsumerRequired(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, name := range []string{"", " ", "\t\n", "\u00a0"} {
		_, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
			Store:    e.store,
			Consumer: name,
		}, nil)
		require.ErrorIs(t, err, inbox.ErrNoConsumer, "consumer %q", name)
		require.ErrorContains(t, err, "Config.Consumer", "consumer %q", name)
	}
}

// TestNilHandleFailsAtConstruction (D14): a beginner on a nil pool or *sql.DB
// is refused when it is built, not with a panic per message.
func TestNilHandleFailsAtConstruction(t *testing.T) {
	t.Parallel()
	_, err := inbox.NewPgxBeginner(nil, inbox.PgxBeginnerConfig{})
	require.ErrorIs(t, err, inbox.ErrNilHandle)
	require.ErrorContains(t, err, "NewPgxBeginner")
	_, err = inbox.NewPgxBeginner(nil, inbox.PgxBeginnerConfig{DisablePipeline: true})
	require.ErrorIs(t, err, inbox.ErrNilHandle)
	_, err = inbox.NewStdBeginner(nil)
	require.ErrorIs(t, err, inbox.ErrNilHandle)
	require.ErrorContains(t, err, "NewStdBeginner")
}
