package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// endTx ends the attempt's transaction from inside the handler (a misuse the
// docs forbid), on whichever driver the attempt runs.
func endTx(t *testing.T, msg *message.Message, commit bool) {
	ctx := msg.Context()
	if tx, ok := inbox.PgxTxFromContext(ctx); ok {
		if commit {
			require.NoError(t, tx.Commit(ctx))
		} else {
			require.NoError(t, tx.Rollback(ctx))
		}
		return
	}
	tx, ok := inbox.SQLTxFromContext(ctx)
	require.True(t, ok)
	if commit {
		require.NoError(t, tx.Commit())
	} else {
		require.NoError(t, tx.Rollback())
	}
}

// TestHandlerRolledBackTxIsNotInfrastructure: a handler that rolls back the
// attempt's transaction itself makes the middleware's COMMIT fail with
// pgx.ErrTxClosed / sql.ErrTxDone. That is the handler's doing, not the
// connection's: it must be poisoned, never an
// InfrastructureError held in place forever (each hold re-runs the handler,
// which rolls back again, then nacks after MaxHold, and the broker
// redelivers: an endless loop that never reaches the poison topic). It is
// permanent (poisoned once at once), also when the handler
// committed (its effect applied once; its produced messages were not
// written, which the poisoned message makes visible). No connection stays
// acquired.
func TestHandlerRolledBackTxIsNotInfrastructure(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, b := range beginnersUnderTest(t, e.schema) {
		for _, commit := range []bool{false, true} {
			name := b.name + "/rollback"
			if commit {
				name = b.name + "/commit"
			}
			t.Run(name, func(t *testing.T) {
				idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b.beginner, Store: e.store, Consumer: "rv-" + name}, nil)
				require.NoError(t, err)
				poison := &capture{msgs: make(chan *message.Message, 2)}
				mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
					Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
					MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond,
					MaxHold: -1, // held until the message context ends: only the class decides
				}, nil)
				require.NoError(t, err)
				calls := 0
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				h := mw(func(msg *message.Message) ([]*message.Message, error) {
					calls++
					if calls > 10 { // held in a loop: end it, the test fails below
						cancel()
						return nil, context.Canceled
					}
					if err := writeEffectQ(msg, name); err != nil {
						return nil, err
					}
					endTx(t, msg, commit)
					return nil, nil
				})
				id := newID()
				msg := newMsg(id)
				msg.SetContext(ctx)
				_, err = h(msg)
				require.NoError(t, err, "acked")
				require.Zero(t, b.inUse(), "no connection stays acquired")
				// A transaction the handler ended is permanent
				// ("handler_ended_tx", TestHandlerEndedTxIsPoisonedNotSilentlyLost):
				// poisoned once at once, never held, never retried.
				require.Equal(t, 1, calls, "permanent: poisoned at once")
				require.Len(t, poison.msgs, 1, "poisoned once")
				require.Equal(t, "permanent", (<-poison.msgs).Metadata.Get(inbox.MetadataPoisonClass))
				if commit {
					require.Equal(t, 1, e.effects(id), "the handler committed its effect")
					require.Equal(t, 1, e.processed(id))
					return
				}
				require.Zero(t, e.effects(id))
				require.Zero(t, e.processed(id))
			})
		}
	}
}

// TestHoldLogsUseErrorField: the chain's hold lines name the error
// "error", as the middleware's own lines and watermill.NewSlogLogger do,
// never "err" (the merged hold path logged "err", and its ERROR lines
// carried the error twice).
func TestHoldLogsUseErrorField(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logger := &captureLogger{}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})), Store: e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: &capture{msgs: make(chan *message.Message, 1)}, PoisonTopic: "poison",
		InitialInterval: time.Millisecond, MaxInterval: time.Millisecond, MaxHold: -1,
	}, logger)
	require.NoError(t, err)
	calls := 0
	_, err = mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		switch calls {
		case 1:
			return nil, inbox.Transient(errors.New("provider says later"))
		case 2:
			return nil, &inbox.ConfigurationError{Hint: "fix it", Err: errors.New("missing grant")}
		}
		return nil, writeEffect(msg, "x")
	})(newMsg(E1))
	require.NoError(t, err)
	logger.mu.Lock()
	defer logger.mu.Unlock()
	held := 0
	for _, l := range logger.lines {
		require.NotContains(t, l.fields, "err", l.msg)
		if l.fields["held"] != nil {
			held++
			require.Contains(t, fmt.Sprint(l.fields["error"]), map[int]string{0: "provider says later", 1: "missing grant"}[l.fields["held"].(int)], l.msg)
		}
	}
	require.Equal(t, 2, held)
}

// TestClaimStatementTimeoutIsInfrastructure: the claim on the attempt's
// own connection cancelled by the server (57014 query_canceled: a
// statement_timeout set on the role or the pool while another transaction
// holds the claim) is the attempt's infrastructure: transient, held. The
// merged claimError took every "ordinary" SQLSTATE of the claim for a
// schema mismatch and reported a ConfigurationError telling the operator to
// run the migrations.
func TestClaimStatementTimeoutIsInfrastructure(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := testenv.PoolConfig(t, testenv.PostgresURL(), e.schema, 2)
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "100ms"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	for _, pipelined := range []bool{true, false} {
		idem, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{DisablePipeline: !pipelined})),
			Store:    e.store, Consumer: "stock", LockTimeout: -1, // the session's lock_timeout (none): statement_timeout decides
		}, nil)
		require.NoError(t, err)
		id := newID()
		// Another delivery of the same event holds its claim, uncommitted.
		holder, err := e.pool.Begin(context.Background())
		require.NoError(t, err)
		_, err = holder.Exec(context.Background(), `INSERT INTO processed_event (consumer, event_id) VALUES ('stock', $1)`, id)
		require.NoError(t, err)
		_, err = idem.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(newMsg(id))
		require.NoError(t, holder.Rollback(context.Background()))
		require.Error(t, err)
		var pg *pgconn.PgError
		require.ErrorAs(t, err, &pg)
		require.Equal(t, "57014", pg.Code)
		require.False(t, inbox.IsConfiguration(err), "not a schema problem: %v", err)
		require.True(t, inbox.IsTransient(err), "%v", err)
		require.ErrorIs(t, err, inbox.ErrInfrastructure)
	}
}
