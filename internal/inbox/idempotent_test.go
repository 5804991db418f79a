package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Event ids of the numbered cases (C01, C08, …; valid UUIDv7).
var (
	E1 = "01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b"
	E2 = "01906dbc-ad01-70b2-9b2c-3d4e5f6a7b8c"
)

// env is one test's database: a schema with the processed table and an
// "effect" table the handlers write to.
type env struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
	store  *processedstore.Store
}

func newEnv(t *testing.T) *env {
	t.Helper()
	pool, schema := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background(), sqldb.Pgx(pool)))
	// As NewConsumer: the consumer's name registered before its claims.
	require.NoError(t, store.CheckLean(context.Background(), sqldb.Pgx(pool), "stock"))
	_, err = pool.Exec(context.Background(), `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)
	return &env{t: t, pool: pool, schema: schema, store: store}
}

func (e *env) mw(pool *pgxpool.Pool, mod func(*inbox.Config)) message.HandlerMiddleware {
	e.t.Helper()
	cfg := inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store,
		Consumer: "stock",
	}
	if mod != nil {
		mod(&cfg)
	}
	m, err := inbox.NewIdempotent(cfg, watermill.NopLogger{})
	require.NoError(e.t, err)
	return m.Middleware
}

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.pool.QueryRow(context.Background(), query, args...).Scan(&n))
	return n
}

func (e *env) effects(id string) int {
	return e.count(`SELECT count(*) FROM effect WHERE event_id = $1`, id)
}

func (e *env) processed(id string) int {
	return e.count(`SELECT count(*) FROM processed_event WHERE event_id = $1`, id)
}

// writeEffect is the handlers' effect: one row in the attempt's transaction.
func writeEffect(msg *message.Message, note string) error {
	tx, ok := inbox.PgxTxFromContext(msg.Context())
	if !ok {
		return errors.New("no tx in context")
	}
	_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, msg.UUID, note)
	return err
}

func newMsg(id string) *message.Message {
	m := message.NewMessage(id, []byte(`{}`))
	m.Metadata.Set(marshaler.MetadataEventName, "order.placed")
	return m
}

// TestFailedAttemptLeavesNoClaim (C01) — a failed attempt must not leave its claim behind (base: the
// broker redelivers after an error).
func TestFailedAttemptLeavesNoClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		if err := writeEffect(msg, fmt.Sprint("attempt ", n)); err != nil {
			return nil, err
		}
		if n == 1 {
			return nil, errors.New("boom")
		}
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.ErrorContains(t, err, "boom")
	require.Equal(t, 0, e.processed(E1), "the failed attempt's claim must roll back")
	require.Equal(t, 0, e.effects(E1))
	_, err = h(newMsg(E1)) // redelivery
	require.NoError(t, err)
	_, err = h(newMsg(E1)) // and once more: a duplicate
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
}

// TestPanickedAttemptLeavesNoClaim (C01 B) — attempt 1 panics, with Watermill's Recoverer in the chain.
func TestPanickedAttemptLeavesNoClaim(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := wmw.Recoverer(e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		require.NoError(t, writeEffect(msg, "x"))
		if n == 1 {
			panic("kaboom")
		}
		return nil, nil
	}))
	_, err := h(newMsg(E1))
	var rp wmw.RecoveredPanicError
	require.ErrorAs(t, err, &rp)
	require.Equal(t, "kaboom", rp.V)
	require.EqualValues(t, 0, e.pool.Stat().AcquiredConns(), "connection back in the pool after a panic")
	require.Equal(t, 0, e.processed(E1))
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
}

// TestInProcessRetryRunsInAFreshTransaction (C01 C) — Watermill's Retry retries in-process: each attempt runs in a
// fresh transaction and sees nothing of the failed one.
func TestInProcessRetryRunsInAFreshTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	var seen []int
	var txs []pgx.Tx
	retry := wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}
	msg := newMsg(E1)
	origCtx := context.WithValue(context.Background(), struct{}{}, "orig")
	msg.SetContext(origCtx)
	h := retry.Middleware(e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		tx, ok := inbox.PgxTxFromContext(msg.Context())
		require.True(t, ok)
		txs = append(txs, tx)
		var visible int
		require.NoError(t, tx.QueryRow(msg.Context(), `SELECT count(*) FROM effect WHERE event_id = $1`, msg.UUID).Scan(&visible))
		seen = append(seen, visible)
		require.NoError(t, writeEffect(msg, "x"))
		if n == 1 {
			return nil, errors.New("transient-ish")
		}
		return nil, nil
	}))
	_, err := h(msg)
	require.NoError(t, err)
	require.EqualValues(t, 2, calls.Load())
	require.Equal(t, []int{0, 0}, seen, "the second attempt must not see the first one's write")
	require.NotSame(t, txs[0], txs[1], "a fresh transaction per attempt")
	require.Equal(t, origCtx, msg.Context(), "the original context is restored")
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
}

// TestTwoConsumersAtOnceApplyOnce (C08) — two consumers (separate pools, as two instances), one event, same moment.
func TestTwoConsumersAtOnceApplyOnce(t *testing.T) {
	t.Parallel()
	for _, variant := range []string{"A", "B"} {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			poolA := testenv.PoolOn(t, e.schema, 2)
			poolB := testenv.PoolOn(t, e.schema, 2)
			var calls atomic.Int32
			firstIn := make(chan struct{})
			handler := func(msg *message.Message) ([]*message.Message, error) {
				n := calls.Add(1)
				if err := writeEffect(msg, "x"); err != nil {
					return nil, err
				}
				if n == 1 {
					close(firstIn)
					time.Sleep(2 * time.Second)
					if variant == "B" {
						return nil, errors.New("first attempt fails after 2 s")
					}
				}
				return nil, nil
			}
			hA := e.mw(poolA, nil)(handler)
			hB := e.mw(poolB, nil)(handler)
			errA := make(chan error, 1)
			go func() { _, err := hA(newMsg(E1)); errA <- err }()
			<-firstIn
			_, errB := hB(newMsg(E1)) // waits on the primary key, then decides
			ea := <-errA
			var pgErr *pgconn.PgError
			require.False(t, errors.As(errB, &pgErr), "no SQL error reaches user code: %v", errB)
			require.NoError(t, errB)
			switch variant {
			case "A":
				require.NoError(t, ea)
				require.EqualValues(t, 1, calls.Load())
			case "B":
				require.ErrorContains(t, ea, "first attempt fails")
				require.EqualValues(t, 2, calls.Load())
			}
			require.Equal(t, 1, e.processed(E1))
			require.Equal(t, 1, e.effects(E1))
		})
	}
}

// While one transaction holds the claim longer than LockTimeout, a second
// attempt fails with the transient ErrInFlight, never a permanent error.
func TestLockTimeoutIsTransientInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	release := make(chan struct{})
	holding := make(chan struct{})
	slow := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		close(holding)
		<-release
		return nil, writeEffect(msg, "slow")
	})
	fast := e.mw(e.pool, func(c *inbox.Config) { c.LockTimeout = 100 * time.Millisecond })(func(msg *message.Message) ([]*message.Message, error) {
		t.Error("handler must not run while the claim is held elsewhere")
		return nil, nil
	})
	done := make(chan error, 1)
	go func() { _, err := slow(newMsg(E1)); done <- err }()
	<-holding
	_, err := fast(newMsg(E1))
	require.ErrorIs(t, err, inbox.ErrInFlight)
	require.True(t, inbox.IsTransient(err))
	require.False(t, inbox.IsPermanent(err))
	close(release)
	require.NoError(t, <-done)
	require.Equal(t, 1, e.effects(E1))
}

// A handler that swallows a database error and returns nil: the server
// answers ROLLBACK to COMMIT, so the attempt is a failure, not an ack.
func TestSwallowedDatabaseErrorFailsTheAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		require.NoError(t, writeEffect(msg, "x"))
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO no_such_table VALUES (1)`)
		require.Error(t, err) // swallowed
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.ErrorIs(t, err, inbox.ErrCommit)
	require.ErrorIs(t, err, pgx.ErrTxCommitRollback)
	require.Equal(t, 0, e.processed(E1))
	require.Equal(t, 0, e.effects(E1))
	require.EqualValues(t, 0, e.pool.Stat().AcquiredConns())
}

func TestPanicRollsBackPropagatesAndReleases(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	before := e.pool.Stat().AcquiredConns()
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		require.NoError(t, writeEffect(msg, "x"))
		panic(errors.New("handler bug"))
	})
	msg := newMsg(E1)
	orig := msg.Context()
	require.PanicsWithError(t, "handler bug", func() { _, _ = h(msg) })
	require.Equal(t, orig, msg.Context())
	require.Equal(t, before, e.pool.Stat().AcquiredConns())
	require.Equal(t, 0, e.processed(E1))
	require.Equal(t, 0, e.effects(E1))
}

func TestCancelledContextReleasesAndDoesNotAck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		require.NoError(t, writeEffect(msg, "x"))
		cancel() // shutdown mid-handler
		return nil, nil
	})
	msg := newMsg(E1)
	msg.SetContext(ctx)
	_, err := h(msg)
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err), "shutdown is transient: %v", err)
	require.Eventually(t, func() bool { return e.pool.Stat().AcquiredConns() == 0 }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, 0, e.processed(E1))
	require.Equal(t, 0, e.effects(E1))
}

func TestRejectsBeforeAnySQL(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	for _, id := range []string{"not-a-uuid", "", "12345", "00000000-0000-0000-0000-000000000000"} {
		_, err := h(newMsg(id))
		require.ErrorIs(t, err, inbox.ErrInvalidEventID, id)
		if id == "" { // no adapter decoded it: the wiring, held (TestEmptyUUIDIsAConfigurationErrorNamingTheMarshaler)
			require.True(t, inbox.IsConfiguration(err))
			continue
		}
		require.True(t, inbox.IsPermanent(err))
	}
	bad := message.NewMessage(E1, []byte("{"))
	bad.Metadata.Set(marshaler.MetadataMalformed, "true")
	bad.Metadata.Set(marshaler.MetadataMalformedReason, "envelope: not JSON")
	_, err := h(bad)
	require.ErrorIs(t, err, inbox.ErrMalformed)
	require.True(t, inbox.IsPermanent(err))
	require.EqualValues(t, 0, calls.Load())
	require.Equal(t, 0, e.count(`SELECT count(*) FROM processed_event`))
}

// Event ids in any RFC 9562 text form claim the same row.
func TestEventIDFormsAreOneEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	u := uuid.MustParse(E2)
	for _, form := range []string{E2, "{" + E2 + "}", "urn:uuid:" + E2, fmt.Sprintf("%X", u[:])} {
		_, err := h(newMsg(form))
		require.NoError(t, err, form)
	}
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, e.processed(E2))
}

func TestHandlerCommitOrRollbackFailsTheAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		n := calls.Add(1)
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		require.NoError(t, writeEffect(msg, "x"))
		if n == 1 {
			require.NoError(t, tx.Rollback(msg.Context())) // drops the claim too
		}
		return nil, nil
	})
	_, err := h(newMsg(E1))
	require.ErrorIs(t, err, pgx.ErrTxClosed, "the middleware never acks an attempt whose end it did not see")
	require.Equal(t, 0, e.processed(E1))
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := inbox.NewIdempotent(inbox.Config{}, nil)
	require.ErrorContains(t, err, "Config.Beginner")
	_, err = inbox.NewIdempotent(inbox.Config{
		Beginner:    inbox.NewSQLSubscriberBeginner(),
		Consumer:    "c",
		LockTimeout: time.Microsecond,
	}, nil)
	require.ErrorContains(t, err, "Config.LockTimeout")
}

// recorder counts outcomes.
type recorder = idempotencytest.Outcomes

func TestDuplicateIsCountedAndAcked(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *inbox.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeEffect(msg, "x")
	})
	for i := 0; i < 3; i++ {
		_, err := h(newMsg(E1))
		require.NoError(t, err)
	}
	require.Equal(t, 1, rec.Count(inbox.OutcomeProcessed))
	require.Equal(t, 2, rec.Count(inbox.OutcomeDuplicate))
	require.Equal(t, 1, e.effects(E1))
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}
