package inbox_test

// The lock timeout as the session's lock_timeout on the prepared claim over
// a direct connection (connClaim.sessionLock), with the claim's own
// set_config backstop, and the COMMIT sent through pgconn: what a handler,
// another consumer or other code on the pool can do to the session, and
// what stays bounded.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// lockFailsafe ends a claim that waits on a lock the lock timeout should
// have bounded (50ms); reaching it is the defect.
const lockFailsafe = 3 * time.Second

type lockEnv struct {
	pool   *pgxpool.Pool
	schema string
	store  *processedstore.Store
	b      inbox.TxBeginner
}

// lockSetup: a pool in pgx's default mode (the prepared claim) on a
// fresh schema, a schema-qualified store, the effect table.
func lockSetup(t *testing.T, maxConns int32, tweak func(*pgxpool.Config)) lockEnv {
	return preparedEnv(t, pgx.QueryExecModeCacheStatement, maxConns, tweak)
}

// consumer returns the middleware-wrapped handler of consumer name with
// lock timeout lock; fn runs in the attempt's transaction, then the effect
// row is written.
func (e lockEnv) consumer(t *testing.T, name string, lock time.Duration, fn func(ctx context.Context, tx pgx.Tx) error) message.HandlerFunc {
	t.Helper()
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: name, LockTimeout: lock}, watermill.NopLogger{})
	require.NoError(t, err)
	return m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		if fn != nil {
			if err := fn(msg.Context(), tx); err != nil {
				return nil, err
			}
		}
		// Unnamed, not in the simple protocol: pgx would write the
		// arguments into the text, which makes every next claim set the
		// lock timeout again and would hide what these tests measure; and
		// a statement of pgx's cache would be lost with the claim's when a
		// test drops them all (DEALLOCATE ALL).
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, $2)`, pgx.QueryExecModeExec, msg.UUID, name)
		return nil, err
	})
}

// claimWaitIsBounded holds the claim table in ACCESS EXCLUSIVE mode from
// another session and runs one new message: with the lock timeout in force
// the attempt fails with ErrInFlight after it; an unbounded claim waits
// until the failsafe.
func (e lockEnv) claimWaitIsBounded(t *testing.T, h message.HandlerFunc) {
	t.Helper()
	claimOnHeldTableIsInFlight(t, h, pgx.Identifier{e.schema, "processed_event"}.Sanitize(), lockFailsafe)
}

// lockTimeoutOf reads the session's lock_timeout without naming it in the
// SQL text (a statement that names it makes the next claim set it again,
// which would hide what is measured).
func lockTimeoutOf(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (string, error) {
	var s string
	err := q.QueryRow(ctx, "SELECT current_setting($1)", "lock_timeout").Scan(&s)
	return s, err
}

func (e lockEnv) show(t *testing.T) string {
	t.Helper()
	var s string
	require.NoError(t, e.pool.QueryRow(context.Background(), "SHOW lock_timeout").Scan(&s))
	return s
}

// sessionChangeThenNext runs attempt 1 with change, then attempt 2, whose
// handler reports its lock_timeout; then a claim against a held claim
// table. Pool of one connection: every attempt is on the same session.
func sessionChangeThenNext(t *testing.T, change func(ctx context.Context, tx pgx.Tx) error) {
	sessionChangeThenProbe(t, false, change)
}

// sessionChangeThenProbe is sessionChangeThenNext; with duplicate, the
// last probe is a second concurrent delivery of an event whose first
// delivery is in flight (another pool holds its claim uncommitted): it
// must fail with ErrInFlight after the lock timeout.
func sessionChangeThenProbe(t *testing.T, duplicate bool, change func(ctx context.Context, tx pgx.Tx) error) {
	e := lockSetup(t, 1, nil)
	var step atomic.Int32
	var seen string
	h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		if step.Load() == 0 {
			return change(ctx, tx)
		}
		var err error
		seen, err = lockTimeoutOf(ctx, tx)
		return err
	})
	_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
	step.Store(1)
	_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
	require.NoError(t, err)
	assert.Equal(t, "50ms", seen, "the next attempt's handler runs under Config.LockTimeout")
	if duplicate {
		e.duplicateWaitIsBounded(t, h)
		return
	}
	e.claimWaitIsBounded(t, h)
}

// duplicateWaitIsBounded: the first delivery of an event runs on another
// pool and holds its claim (handler blocked); the second, through h, must
// give up after the lock timeout with ErrInFlight.
func (e lockEnv) duplicateWaitIsBounded(t *testing.T, h message.HandlerFunc) {
	t.Helper()
	other := testenv.PoolOn(t, e.schema, 1)
	ob, err := inbox.NewPgxBeginner(other, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	om, err := inbox.NewIdempotent(inbox.Config{Beginner: ob, Store: e.store, Consumer: "stock", LockTimeout: 50 * time.Millisecond}, watermill.NopLogger{})
	require.NoError(t, err)
	inHandler, release := make(chan struct{}), make(chan struct{})
	first := om.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		close(inHandler)
		<-release
		return nil, nil
	})
	id := uuid.Must(uuid.NewV7())
	done := make(chan error, 1)
	go func() {
		_, err := first(preparedClaimMsg(t, id, `{"n":7}`))
		done <- err
	}()
	<-inHandler
	msg := preparedClaimMsg(t, id, `{"n":7}`)
	mctx, cancel := context.WithTimeout(context.Background(), lockFailsafe)
	defer cancel()
	msg.SetContext(mctx)
	start := time.Now()
	_, err = h(msg)
	close(release)
	require.NoError(t, <-done)
	require.Error(t, err)
	require.False(t, errors.Is(err, context.DeadlineExceeded),
		"the second delivery waited %s on the first (until the failsafe), not the 50ms lock timeout: %v", time.Since(start).Round(time.Millisecond), err)
	require.ErrorIs(t, err, inbox.ErrInFlight)
	require.False(t, inbox.IsPermanent(err))
}

// A session-level SET lock_timeout made through a savepoint of
// the attempt's transaction (tx.Begin, pgx.BeginFunc(ctx, tx, …): the
// pgx.Tx the handler received) is not seen: Begin builds the savepoint's
// pgxTx without `session`, so sessionSQL is a no-op for every statement
// sent through it. The setting is committed with the attempt and the
// connection's later claims run with lock_timeout = 0: a claim waits
// unbounded on the claim table / a concurrent delivery.
func TestSessionSettingMadeInASavepointIsSeen(t *testing.T) {
	t.Parallel()
	t.Run("tx.Begin", func(t *testing.T) {
		t.Parallel()
		sessionChangeThenProbe(t, true, func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, "SET lock_timeout = 0"); err != nil {
				return err
			}
			return sp.Commit(ctx)
		})
	})
	t.Run("pgx.BeginFunc", func(t *testing.T) {
		t.Parallel()
		sessionChangeThenProbe(t, true, func(ctx context.Context, tx pgx.Tx) error {
			return pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
				_, err := sp.Exec(ctx, "RESET ALL")
				return err
			})
		})
	})
}

// The scan looks at the SQL text only: a set_config whose name
// is a parameter changes the session's lock_timeout through the attempt's
// own pgx.Tx unseen (likewise a name built by concatenation).
func TestSetConfigWithItsNameAsAParameterIsSeen(t *testing.T) {
	t.Parallel()
	t.Run("parameter", func(t *testing.T) {
		t.Parallel()
		sessionChangeThenNext(t, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT set_config($1, $2, false)", "lock_timeout", "0")
			return err
		})
	})
	t.Run("concatenation", func(t *testing.T) {
		t.Parallel()
		sessionChangeThenNext(t, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT set_config('lock' || '_timeout', '0', false)")
			return err
		})
	})
}

// "A negative LockTimeout leaves the session's lock_timeout
// untouched": the pool's sessions carry lock_timeout = 5s (RuntimeParams,
// the recipe the parent commit documented for LockTimeout < 0). Another
// consumer with LockTimeout 60ms on the same pool overwrites the session
// setting for good, so the negative consumer's claims and handlers run
// under 60ms: its second delivery of an event gives up after 60ms instead
// of waiting up to 5s for the first to commit, and its handler statements
// fail with 55P03 after 60ms.
func TestNegativeLockTimeoutKeepsTheSessionsOwnValueOnASharedPool(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["lock_timeout"] = "5s" })
	var seenB string
	hA := e.consumer(t, "a", 60*time.Millisecond, nil)
	hB := e.consumer(t, "b", -1, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		seenB, err = lockTimeoutOf(ctx, tx)
		return err
	})
	_, err := hB(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
	require.Equal(t, "5s", seenB, "before consumer a ran: the session's own setting")
	_, err = hA(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
	require.NoError(t, err)
	_, err = hB(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":3}`))
	require.NoError(t, err)
	assert.Equal(t, "5s", seenB, "consumer b (LockTimeout < 0) runs under the session's own lock_timeout")
	assert.Equal(t, "5s", e.show(t), "the pool's sessions keep their configured lock_timeout")
}

// A session change made through tx.Conn() (the handler reached the
// connection itself, so the client sees none of what it sends there from
// then on): the claim on that connection sets LockTimeout for its own
// transaction in its WHERE (withLockBackstop) on every later attempt, so
// the next attempt's handler runs under it and a second concurrent
// delivery of an event in flight gives up after it with ErrInFlight. Only
// the claim's wait for its table lock (DDL, LOCK TABLE) then follows the
// session's new value: the limit docs/guarantees.md states.
func TestSessionChangeThroughTxConnLeavesConcurrentDeliveryAndHandlerBounded(t *testing.T) {
	t.Parallel()
	sessionChangeThenProbe(t, true, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Conn().Exec(ctx, "SET lock_timeout = 0")
		return err
	})
}

// A session change no handler statement names (inside a function the
// handler calls, by other code on the pool between attempts) is not seen
// by the claim, which carries no check of its own (issue 25: 8k server
// instructions a claim): the connection's next claims run under the
// changed value until the claim sets the session's value again, at most
// SessionLockRecheck claims later. Then the handler runs under
// LockTimeout again and a second concurrent delivery of an event in
// flight gives up after it with ErrInFlight.
func TestUnseenSessionChangeLastsAtMostSessionLockRecheckClaims(t *testing.T) {
	t.Parallel()
	for name, change := range map[string]func(t *testing.T, e lockEnv) func(ctx context.Context, tx pgx.Tx) error{
		"function": func(t *testing.T, e lockEnv) func(ctx context.Context, tx pgx.Tx) error {
			_, err := e.pool.Exec(context.Background(), `CREATE FUNCTION relax() RETURNS void LANGUAGE sql AS $$ SELECT set_config('lock' || '_timeout', '0', false) $$`)
			require.NoError(t, err)
			return func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SELECT relax()")
				return err
			}
		},
		"other code on the pool": func(t *testing.T, e lockEnv) func(ctx context.Context, tx pgx.Tx) error {
			return nil // RESET ALL on the pool after the first attempt
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := lockSetup(t, 1, nil)
			first := change(t, e)
			var seen string
			h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
				if first != nil {
					f := first
					first = nil
					return f(ctx, tx)
				}
				var err error
				seen, err = lockTimeoutOf(ctx, tx)
				return err
			})
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
			if name == "other code on the pool" {
				_, err = e.pool.Exec(context.Background(), "RESET ALL") // e.g. a library resetting its session
				require.NoError(t, err)
			}
			require.Equal(t, "0", e.show(t), "the change is the session's")
			seen = ""
			n := 0
			for seen != "50ms" {
				n++
				require.LessOrEqual(t, n, inbox.SessionLockRecheck, "the handler ran under %q for %d claims after the session's change", seen, n)
				_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
				require.NoError(t, err)
			}
			require.Greater(t, n, 1, "the change was seen at once: this test no longer exercises the recheck")
			e.duplicateWaitIsBounded(t, h)
		})
	}
}

// A session change sent through the attempt's own pgx.Tx in a form the
// text scan does not name: a statement prepared by the handler and run by
// its name (pgx's Prepare then Exec of the name, SQL PREPARE then
// EXECUTE), a value pgx writes into the text (the simple protocol with
// arguments; a dollar quote pgx's lexer does not know lets it run as
// SQL), a Unicode-escaped name, an UPDATE of pg_settings. Each makes the
// next claim set LockTimeout again, as a statement naming lock_timeout
// does: the next attempt's handler runs under it and a second concurrent
// delivery of an event in flight gives up after it. They were unbounded
// (until the recheck, 256 claims later) once the claim no longer checked
// the setting itself.
func TestSessionChangeTheScanDoesNotNameIsSeen(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		setup, change func(ctx context.Context, tx pgx.Tx) error
	}{
		"tx.Prepare then its name": {
			setup: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Prepare(ctx, "relax", "SELECT set_config('lock_timeout', '0', false)")
				return err
			},
			change: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "relax")
				return err
			},
		},
		"SQL PREPARE then EXECUTE": {
			setup: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "PREPARE relax AS SELECT set_config('lock_timeout', '0', false)", pgx.QueryExecModeSimpleProtocol)
				return err
			},
			change: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "EXECUTE relax", pgx.QueryExecModeSimpleProtocol)
				return err
			},
		},
		"simple protocol argument run as SQL": {
			change: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SELECT $q$ $1 $q$", pgx.QueryExecModeSimpleProtocol, "x $q$; SET lock_timeout = 0; SELECT $q$ y")
				return err
			},
		},
		"Unicode-escaped name": {
			change: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `SET U&"lock\005ftimeout" = 0`)
				return err
			},
		},
		"pg_settings": {
			change: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `UPDATE pg_settings SET setting = '0' WHERE name = 'lock' || '_timeout'`)
				return err
			},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			sessionChangeRepeatedThenProbe(t, c.setup, c.change)
		})
	}
}

// sessionChangeRepeatedThenProbe: attempt 1 runs setup (when not nil) then
// change, attempt 2 runs change again (a statement prepared on attempt 1
// is run by name there, its text unseen), attempt 3's handler reports its
// lock_timeout, then a second concurrent delivery must give up after the
// 50ms lock timeout. Pool of one connection: every attempt is on the same
// session.
func sessionChangeRepeatedThenProbe(t *testing.T, setup, change func(ctx context.Context, tx pgx.Tx) error) {
	e := lockSetup(t, 1, nil)
	var step atomic.Int32
	var changed, seen string
	h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		switch step.Load() {
		case 0:
			if setup != nil {
				if err := setup(ctx, tx); err != nil {
					return err
				}
			}
			return change(ctx, tx)
		case 1:
			if err := change(ctx, tx); err != nil {
				return err
			}
			var err error
			changed, err = lockTimeoutOf(ctx, tx)
			return err
		}
		var err error
		seen, err = lockTimeoutOf(ctx, tx)
		return err
	})
	for i := int32(0); i < 3; i++ {
		step.Store(i)
		_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), fmt.Sprintf(`{"n":%d}`, i)))
		require.NoError(t, err)
	}
	require.Equal(t, "0", changed, "the change took effect")
	assert.Equal(t, "50ms", seen, "the next attempt's handler runs under Config.LockTimeout")
	e.duplicateWaitIsBounded(t, h)
}

// two consumers with different LockTimeouts on one
// connection: each attempt runs under its own (lockMs is compared).
func TestTwoConsumersWithTwoLockTimeoutsOnOneConnection(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, nil)
	var seen []string
	show := func(ctx context.Context, tx pgx.Tx) error {
		s, err := lockTimeoutOf(ctx, tx)
		seen = append(seen, s)
		return err
	}
	hA := e.consumer(t, "a", 60*time.Millisecond, show)
	hB := e.consumer(t, "b", 2*time.Second, show)
	for i := 0; i < 2; i++ {
		for _, h := range []message.HandlerFunc{hA, hB, hA, hA} {
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
		}
	}
	require.Equal(t, []string{"60ms", "2s", "60ms", "60ms", "60ms", "2s", "60ms", "60ms"}, seen)
}

// SET LOCAL / SET SESSION / RESET through the attempt's own
// tx: the next attempt runs under LockTimeout; the claim stays bounded.
func TestSessionLockTimeoutChangesThroughTheAttemptAreSeen(t *testing.T) {
	t.Parallel()
	for _, q := range []string{"SET LOCAL lock_timeout = 0", "SET lock_timeout = 0", "RESET lock_timeout"} {
		t.Run(q, func(t *testing.T) {
			t.Parallel()
			sessionChangeThenNext(t, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, q)
				return err
			})
		})
	}
}

// the COMMIT through pgconn never acks a COMMIT that did
// not commit: a deferred constraint failing at COMMIT (23505, the server
// rolled back), and a connection cut while COMMIT is in flight. Nothing is
// applied twice after the redelivery.
func TestCommitErrorsOfAMarkedClaimAreNeverAcked(t *testing.T) {
	t.Parallel()
	t.Run("deferred constraint", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		e := lockSetup(t, 1, nil)
		_, err := e.pool.Exec(ctx, `CREATE TABLE uniq (k int, CONSTRAINT uk UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)`)
		require.NoError(t, err)
		h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO uniq VALUES (1), (1)")
			return err
		})
		id := uuid.Must(uuid.NewV7())
		_, err = h(preparedClaimMsg(t, id, `{"n":1}`))
		require.Error(t, err, "a COMMIT that rolled back is never acked")
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, "SELECT count(*) FROM effect").Scan(&n))
		require.Equal(t, 0, n)
		require.NoError(t, e.pool.QueryRow(ctx, "SELECT count(*) FROM processed_event").Scan(&n))
		require.Equal(t, 0, n)
	})
	t.Run("failed statement swallowed", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		e := lockSetup(t, 1, nil)
		h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, "SELECT 1/0")
			return nil
		})
		_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
		require.Error(t, err)
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, "SELECT count(*) FROM processed_event").Scan(&n))
		require.Equal(t, 0, n)
	})
	t.Run("cut during COMMIT", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		cfg0 := testenv.PoolConfig(t, testenv.PostgresURL(), "x", 1)
		proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg0.ConnConfig.Host, cfg0.ConnConfig.Port))
		require.NoError(t, err)
		t.Cleanup(func() { _ = proxy.Close() })
		var hang atomic.Bool
		e := lockSetup(t, 1, func(c *pgxpool.Config) {
			c.ConnConfig.Host, c.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
		})
		// Hang the proxy once the handler is done (its effect row was
		// written): COMMIT is held, then the connection is cut.
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: "stock2", LockTimeout: 50 * time.Millisecond}, watermill.NopLogger{})
		require.NoError(t, err)
		h2 := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.PgxTxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'x')`, pgx.QueryExecModeSimpleProtocol, msg.UUID)
			if err == nil && hang.Load() {
				proxy.Hang()
				go func() { time.Sleep(300 * time.Millisecond); proxy.Cut(); proxy.Resume() }()
			}
			return nil, err
		})
		_, err = h2(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":0}`)) // warm
		require.NoError(t, err)
		id := uuid.Must(uuid.NewV7())
		hang.Store(true)
		_, err = h2(preparedClaimMsg(t, id, `{"n":1}`))
		require.Error(t, err, "a COMMIT whose answer never came must not be acked")
		hang.Store(false)
		_, err = h2(preparedClaimMsg(t, id, `{"n":1}`)) // redelivery
		require.NoError(t, err)
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, "SELECT count(*) FROM effect WHERE event_id = $1", id).Scan(&n))
		require.Equal(t, 1, n, "applied exactly once")
	})
}

// the context ends while the session's lock timeout is
// being set (the connection's first round trip of the attempt): the
// attempt fails, not permanently, the connection is dropped, and the next
// attempt runs under the lock timeout.
func TestDeadlineWhileSettingTheSessionLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg0 := testenv.PoolConfig(t, testenv.PostgresURL(), "x", 1)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg0.ConnConfig.Host, cfg0.ConnConfig.Port))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	e := lockSetup(t, 1, func(c *pgxpool.Config) {
		c.ConnConfig.Host, c.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	})
	var seen string
	h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		var err error
		seen, err = lockTimeoutOf(ctx, tx)
		return err
	})
	// A fresh connection (lockMs 0), warmed outside the consumer.
	_, err = e.pool.Exec(ctx, "SELECT 1")
	require.NoError(t, err)
	proxy.Hang()
	msg := preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`)
	mctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	msg.SetContext(mctx)
	_, err = h(msg)
	proxy.Resume()
	require.Error(t, err)
	require.False(t, inbox.IsPermanent(err), "%v", err)
	_, err = h(preparedClaimMsg(t, uuid.MustParse(msg.UUID), `{"n":1}`))
	require.NoError(t, err)
	require.Equal(t, "50ms", seen)
}

// CHECK (control): the probes above pass when the handler changes nothing,
// so their failures are the session change's.
func TestLockTimeoutProbesPassWithoutAChange(t *testing.T) {
	t.Parallel()
	for _, dup := range []bool{false, true} {
		t.Run(fmt.Sprint("duplicate=", dup), func(t *testing.T) {
			t.Parallel()
			sessionChangeThenProbe(t, dup, func(ctx context.Context, tx pgx.Tx) error { return nil })
		})
	}
}

type reviewTracer struct{ sql []string }

func (r *reviewTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.sql = append(r.sql, d.SQL)
	return ctx
}
func (r *reviewTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (r *reviewTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		r.sql = append(r.sql, q.SQL)
	}
	return ctx
}
func (r *reviewTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *reviewTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// MINOR (observability): on a traced pool the round trip that sets the
// session's lock_timeout (sessionLock, pgconn directly) is invisible to the
// pool's tracer; the tracer's picture of the attempt has no lock timeout at
// all (no SET LOCAL in the traced batch either). COMMIT is traced (checked).
func TestSessionLockTimeoutIsTraced(t *testing.T) {
	t.Parallel()
	tr := &reviewTracer{}
	e := lockSetup(t, 1, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr })
	h := e.consumer(t, "stock", 50*time.Millisecond, nil)
	tr.sql = nil
	_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
	require.Contains(t, tr.sql, "commit", "COMMIT goes through pgx on a traced pool")
	lock := false
	for _, q := range tr.sql {
		lock = lock || strings.Contains(q, "lock_timeout")
	}
	require.True(t, lock, "a traced statement sets lock_timeout; traced: %q", tr.sql)
}

// the first claim on a fresh connection, while the claim
// table is held: the session's lock timeout is set before the claim is
// prepared, so even the PREPARE's wait is bounded (ErrInFlight, not the
// failsafe); the next attempt on a fresh connection succeeds.
func TestFirstClaimOnAFreshConnectionIsBounded(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, nil)
	h := e.consumer(t, "stock", 50*time.Millisecond, nil)
	e.pool.Reset() // no connection has claimed yet
	e.claimWaitIsBounded(t, h)
	_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
}

// A counted attempt (a redelivery under the crash bound) ends its count in
// its own transaction through the connection the library reaches itself:
// that must not mark the connection raw (as a handler's tx.Conn() does),
// or every later claim on it would carry the lock timeout's check in its
// statement (8k server instructions) and every commit the guard's
// statement.
func TestCountedAttemptLeavesItsConnectionUnmarked(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, nil)
	var checked, counts int
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: e.b, Store: e.store, Consumer: "stock", LockTimeout: 50 * time.Millisecond, MaxCrashes: 3, CrashQuerier: sqldb.Pgx(e.pool)}, watermill.NopLogger{})
	require.NoError(t, err)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		err := tx.QueryRow(msg.Context(), `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%' AND statement LIKE '%current\_setting%'`).Scan(&checked)
		if err != nil {
			return nil, err
		}
		return nil, tx.QueryRow(msg.Context(), `SELECT count(*) FROM processed_event_crash`).Scan(&counts)
	})
	counted := preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`)
	marshaler.SetRedelivered(counted, true)
	_, err = h(counted)
	require.NoError(t, err)
	require.Equal(t, 1, counts, "the attempt was counted")
	var left int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event_crash`).Scan(&left))
	require.Zero(t, left, "its count ended with it")
	_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
	require.NoError(t, err)
	require.Zero(t, checked, "the claim after a counted attempt carries the lock timeout's check: the connection was marked raw")
}

// Over a direct connection the claim of an event dated inside
// MaxFutureSkew by the database clock the connection read (with the
// session's lock timeout) goes without the window's future arm
// (ClaimParams.SQLNear, 3k server instructions less); an event dated
// beyond it gets the whole window and is refused as ErrFuture, on the
// same connection, after the clock was read.
func TestClaimInsideTheSkewLeavesTheFutureArmToTheReadClock(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, nil)
	h := e.consumer(t, "stock", 50*time.Millisecond, nil)
	claims := func() (near, whole int) {
		require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE statement NOT LIKE '%+ interval%'), count(*) FILTER (WHERE statement LIKE '%+ interval%')
FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%' AND statement LIKE 'INSERT%'`).Scan(&near, &whole))
		return near, whole
	}
	_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
	near, whole := claims()
	require.Equal(t, 1, near, "the claim of an event dated now has no future arm")
	require.Zero(t, whole)
	ahead := preparedClaimMsg(t, uuidV7At(time.Now().Add(e.store.MaxFutureSkew()+time.Minute)), `{"n":2}`)
	_, err = h(ahead)
	require.ErrorIs(t, err, inbox.ErrFuture)
	near, whole = claims()
	require.Equal(t, 1, whole, "an event beyond the skew is judged by the whole window")
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM effect`).Scan(&n))
	require.Equal(t, 1, n)
}

// The session's DateStyle and TimeZone are the deployment's (ALTER
// DATABASE … SET, a role's default, PGDATESTYLE/PGTZ, a pool's
// RuntimeParams), and PostgreSQL writes a timestamptz in the text format
// by them. The claim over a direct connection must not depend on them
// (docs/retention.md: "neither the process time zone nor the session's
// TimeZone enters"). The database clock the connection reads for the near
// claim (ClaimParams.SQLNear) came back as text in them, which pgx parses
// only in ISO with a two-digit offset: every claim failed, transiently,
// for ever.
func TestPreparedClaimUnderAnyDateStyleAndTimeZone(t *testing.T) {
	t.Parallel()
	for name, params := range map[string]map[string]string{
		"DateStyle SQL, DMY": {"DateStyle": "SQL, DMY"},
		"DateStyle German":   {"DateStyle": "German"},
		"TimeZone UTC+100":   {"TimeZone": "UTC+100"},
	} {
		t.Run(name, func(t *testing.T) {
			e := lockSetup(t, 1, func(cfg *pgxpool.Config) {
				for k, v := range params {
					cfg.ConnConfig.RuntimeParams[k] = v
				}
			})
			h := e.consumer(t, "stock", 50*time.Millisecond, nil)
			_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
			require.NoError(t, err)
			var n int
			require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM effect`).Scan(&n))
			require.Equal(t, 1, n)
		})
	}
}

// A handler's session-level SET DateStyle names no lock setting, so the
// claims after it go on under the session's lock_timeout; one event dated
// beyond MaxFutureSkew (refused, permanent, as it should be) then makes the
// next claim on that connection read the database clock again: every
// claim there failed from then on.
func TestClaimsAfterAFutureEventUnderAHandlersDateStyle(t *testing.T) {
	t.Parallel()
	e := lockSetup(t, 1, nil)
	first := true
	h := e.consumer(t, "stock", 50*time.Millisecond, func(ctx context.Context, tx pgx.Tx) error {
		if !first {
			return nil
		}
		first = false
		_, err := tx.Exec(ctx, `SET DateStyle = 'German'`)
		return err
	})
	_, err := h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":1}`))
	require.NoError(t, err)
	_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":2}`))
	require.NoError(t, err)
	_, err = h(preparedClaimMsg(t, uuidV7At(time.Now().Add(e.store.MaxFutureSkew()+time.Hour)), `{"n":3}`))
	require.ErrorIs(t, err, inbox.ErrFuture)
	for i := 4; i < 7; i++ {
		_, err = h(preparedClaimMsg(t, uuid.Must(uuid.NewV7()), `{"n":4}`))
		require.NoError(t, err, "delivery %d", i)
	}
}
