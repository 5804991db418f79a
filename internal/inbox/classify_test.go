package inbox_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// chained wraps h in the recommended chain (NewHandlerMiddleware) with fast
// retries and a short hold, so that a held delivery comes back (nack) within
// the test.
func chained(t *testing.T, idem *inbox.Idempotent, poison message.Publisher, logger watermill.LoggerAdapter, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	return chainedHold(t, idem, poison, logger, 300*time.Millisecond, h)
}

// chainedHold is chained with its own MaxHold: the tests that expect the
// hold to succeed give it room on a loaded machine.
func chainedHold(t *testing.T, idem *inbox.Idempotent, poison message.Publisher, logger watermill.LoggerAdapter, hold time.Duration, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
		MaxRetries: 2, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond,
		MaxHold: hold,
	}, logger)
	require.NoError(t, err)
	return mw(h)
}

func gunzipError() error {
	_, err := gzip.NewReader(bytes.NewReader([]byte{0x1f, 0x8b, 8, 0, 0}))
	return err
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

var _ net.Error = timeoutErr{}

// liteBusy has the shape of modernc.org/sqlite's error with SQLITE_BUSY: a
// handler that gets it from a connection of its own (not the attempt's) is
// not in a transient state of the attempt.
type liteBusy struct{}

func (liteBusy) Error() string { return "database is locked (5) (SQLITE_BUSY)" }
func (liteBusy) Code() int     { return 5 }

// B.8: a handler's own io.EOF, net.Error, DeadlineExceeded or gzip error is
// ordinary: retried MaxRetries times, then poisoned once (today: transient
// by shape, nacked and redelivered forever).
func TestHandlerOwnShapeErrorsAreOrdinary(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	for name, herr := range map[string]error{
		"gunzip":            gunzipError(),
		"io.EOF":            fmt.Errorf("read payload: %w", io.EOF),
		"unexpected EOF":    io.ErrUnexpectedEOF,
		"net.Error":         &net.OpError{Op: "dial", Net: "tcp", Err: timeoutErr{}},
		"deadline exceeded": fmt.Errorf("call provider: %w", context.DeadlineExceeded),
		"ECONNREFUSED":      &os.SyscallError{Syscall: "connect", Err: errors.New("refused")},
		"SQLITE_BUSY shape": fmt.Errorf("other connection: %w", liteBusy{}),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			require.Error(t, herr)
			require.False(t, inbox.IsTransient(herr), "shape alone is not transient")
			poison := &capture{msgs: make(chan *message.Message, 2)}
			var calls atomic.Int32
			h := chained(t, idem, poison, nil, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				return nil, herr
			})
			id := uuid.Must(uuid.NewV7()).String()
			_, err := h(newMsg(id))
			require.NoError(t, err, "poisoned, then acked")
			require.EqualValues(t, 3, calls.Load(), "1 + MaxRetries attempts, then poisoned")
			require.Len(t, poison.msgs, 1)
			require.Equal(t, "exhausted", (<-poison.msgs).Metadata.Get(inbox.MetadataPoisonClass))
			require.Zero(t, e.processed(id))
		})
	}
	require.True(t, inbox.IsTransient(inbox.Transient(io.EOF)), "unless the handler says so")
}

// B.8: the attempt's own connection breaks while the handler runs: the
// handler's error (whatever its shape) comes with a failed rollback, so it
// is infrastructure by origin: held, retried in place, applied once, never
// poisoned.
func TestConnectionLostInHandlerIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	var seen []error
	h := chainedHold(t, idem, poison, nil, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 1 {
			proxy.Cut() // the attempt's connection dies under the handler
		}
		err := writeEffect(msg, "x")
		if err != nil {
			seen = append(seen, err)
		}
		return nil, err
	})
	// Seen from inside: what the handler returns on the cut connection.
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.GreaterOrEqual(t, calls.Load(), int32(2))
	require.NotEmpty(t, seen)
	require.False(t, inbox.IsTransient(seen[0]), "the handler's error alone is not classified transient by shape")
	require.Empty(t, poison.msgs, "held, not poisoned")
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 1, e.processed(E1))
}

// B.8: the connection breaks between the handler's success and COMMIT: the
// failed commit is the middleware's own call, so it is infrastructure by
// origin (held, retried in place); the effect is applied once.
func TestConnectionLostAtCommitIsHeld(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	defer proxy.Close()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	logger := watermill.NewCaptureLogger()
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	h := chainedHold(t, e.idempotent(pool), poison, logger, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if err := writeEffect(msg, "x"); err != nil {
			return nil, err
		}
		if calls.Add(1) == 1 {
			proxy.Cut() // COMMIT will find the connection gone
		}
		return nil, nil
	})
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.GreaterOrEqual(t, calls.Load(), int32(2))
	require.Empty(t, poison.msgs)
	require.Equal(t, 1, e.effects(E1))
	held := 0
	for _, m := range logger.Captured()[watermill.InfoLogLevel] {
		if m.Msg == "Infrastructure failure: delivery held, not poisoned" {
			held++
			require.ErrorIs(t, m.Fields["error"].(error), inbox.ErrInfrastructure)
		}
	}
	require.GreaterOrEqual(t, held, 1, "the failed COMMIT was held (later holds: idle connections the cut killed)")
}

// The chain's outer layer sees the attempt's errors after Retry gave up on
// ordinary ones only: a transient error is not retried by Retry (it is held
// in place instead), so attempts = holds, not holds × MaxRetries.
func TestTransientErrorsSkipRetry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	poison := &capture{msgs: make(chan *message.Message, 1)}
	h := chainedHold(t, idem, poison, nil, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) <= 3 {
			return nil, inbox.Transient(errors.New("provider says later"))
		}
		return nil, writeEffect(msg, "x")
	})
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.EqualValues(t, 4, calls.Load())
	require.Equal(t, 1, e.effects(E1))
	require.Empty(t, poison.msgs)
	_ = wmw.ReasonForPoisonedKey
}

// B.9: a delivery held without a bound (MaxHold < 0) is given back as soon
// as its message context ends (router shutdown), with the transient error:
// never acked, never poisoned.
func TestHoldEndsAtShutdown(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: e.idempotent(e.pool), PoisonPublisher: poison, PoisonTopic: "poison",
		InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond, MaxHold: -1,
	}, nil)
	require.NoError(t, err)
	var calls atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 5 {
			cancel() // the router closes while the delivery is held
		}
		return nil, &pgconn.PgError{Code: "57P03"}
	})
	m := newMsg(E1)
	m.SetContext(ctx)
	_, err = h(m)
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err))
	require.EqualValues(t, 5, calls.Load())
	require.Empty(t, poison.msgs)
}

func (e *env) idempotent(pool *pgxpool.Pool) *inbox.Idempotent {
	e.t.Helper()
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(e.t, err)
	return idem
}
