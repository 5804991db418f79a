package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// faultCalls is how many deliveries of a test's handler hit the fault
// before it stops: more than 1 + MaxRetries (2), so an ordinary error is
// poisoned on the old code, while a held one reaches the healthy call.
const faultCalls = 4

// sqlState is the SQLSTATE in err's chain, or "".
func sqlState(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// TestServerStateCodesAreHeldByClass (item 2): SQLSTATEs of the
// server's state that were not on the old hand list (XX000, 58000, 57014
// from a handler statement, 55006) are transient by their class; each is
// produced for real on the attempt's connection, four deliveries in a
// row: none is poisoned, the fifth call applies the effect once. On the old
// code XX000, 58000, 57014 (outside the claim) and 55006 were ordinary:
// retried twice, then poisoned. 57P01 (the attempt's own backend
// terminated) and 25P03 (idle_in_transaction_session_timeout) were held
// before too and are checked for the kind.
func TestServerStateCodesAreHeldByClass(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	raise := func(code string) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, fmt.Sprintf(`DO $$BEGIN RAISE EXCEPTION 'server state %s' USING ERRCODE = '%s'; END$$`, code, code))
			return err
		}
	}
	cases := []struct {
		name  string
		codes []string // what the handler may see (a dead connection: "")
		fault func(ctx context.Context, tx pgx.Tx) error
	}{
		{"XX000-internal-error", []string{"XX000"}, raise("XX000")},
		{"XX001-data-corrupted", []string{"XX001"}, raise("XX001")},
		{"58000-system-error", []string{"58000"}, raise("58000")},
		{"58P01-undefined-file", []string{"58P01"}, func(ctx context.Context, tx pgx.Tx) error {
			// a file missing on the server's side (superuser function)
			_, err := tx.Exec(ctx, `SELECT pg_read_file('h11-no-such-file-'||pg_backend_pid())`)
			return err
		}},
		{"57014-statement-timeout", []string{"57014"}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '20ms'`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
			return err
		}},
		{"55006-object-in-use", []string{"55006"}, func(ctx context.Context, tx pgx.Tx) error {
			for _, q := range []string{
				`CREATE TEMP TABLE h11_in_use (x int) ON COMMIT DROP`,
				`INSERT INTO h11_in_use VALUES (1), (2)`,
				`DECLARE h11_c CURSOR FOR SELECT x FROM h11_in_use`,
				`FETCH 1 FROM h11_c`,
				`DROP TABLE h11_in_use`,
			} {
				if _, err := tx.Exec(ctx, q); err != nil {
					return err
				}
			}
			return errors.New("DROP TABLE under an open cursor succeeded")
		}},
		{"57P01-own-backend-terminated", []string{"57P01", ""}, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			return err
		}},
		{"25P03-idle-in-transaction-timeout", []string{"25P03", ""}, func(ctx context.Context, tx pgx.Tx) error {
			var pid int
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = '50ms'`); err != nil {
				return err
			}
			testenv.Eventually(t, 30*time.Second, "the idle transaction's backend ended by the server", func(o *testenv.Observed) bool {
				return o.Int("backends", e.count(`SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid)) == 0
			})
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			poison := &capture{msgs: make(chan *message.Message, 1)}
			var calls atomic.Int32
			var mu sync.Mutex
			var seen []error
			h := chainedHold(t, e.idempotent(e.pool), poison, nil, 2*time.Minute, func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := inbox.PgxTxFromContext(msg.Context())
				if calls.Add(1) <= faultCalls {
					err := tc.fault(msg.Context(), tx)
					mu.Lock()
					seen = append(seen, err)
					mu.Unlock()
					return nil, err
				}
				return nil, writeEffect(msg, "x")
			})
			id := uuid.Must(uuid.NewV7()).String()
			_, err := h(newMsg(id))
			require.NoError(t, err)
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, seen, faultCalls)
			for _, err := range seen {
				require.Error(t, err)
				require.Contains(t, tc.codes, sqlState(err), "the fault produced the code for real: %v", err)
			}
			require.Empty(t, poison.msgs, "held as the server's state, never poisoned")
			require.EqualValues(t, faultCalls+1, calls.Load())
			require.Equal(t, 1, e.effects(id))
			require.Equal(t, 1, e.processed(id))
		})
	}
}

// TestSQLStateClassesTransientOrOrdinary (item 2): every code of the transient classes
// and the listed codes of mixed classes, as PostgreSQL 15's errcodes.txt
// names them, is transient wherever it arises; the neighbours that are the
// data's or the handler's stay ordinary.
func TestSQLStateClassesTransientOrOrdinary(t *testing.T) {
	t.Parallel()
	for _, code := range []string{
		"08000", "08003", "08006", "08001", "08004", "08007", "08P01",
		"53000", "53100", "53200", "53300", "53400",
		"57000", "57014", "57P01", "57P02", "57P03", "57P04", "57P05",
		"58000", "58030", "58P01", "58P02", "58P03",
		"72000", "F0000", "F0001", "XX000", "XX001", "XX002",
		"25006", "25P03", "25P04", "40001", "40003", "40P01", "55006", "55P03",
	} {
		err := fmt.Errorf("handler: %w", &pgconn.PgError{Code: code})
		require.Equal(t, inbox.ClassTransient, inbox.ClassOf(err), code)
		require.False(t, inbox.ShouldPoison(err), code)
	}
	for _, code := range []string{"23505", "22012", "25P02", "25001", "40000", "40002", "55000", "P0001", "42601", "0A000"} {
		require.Equal(t, inbox.ClassOrdinary, inbox.ClassOf(&pgconn.PgError{Code: code}), code)
	}
	require.Equal(t, inbox.ClassPermanent, inbox.ClassOf(inbox.Permanent(&pgconn.PgError{Code: "XX000"})), "permanent wins")
}

// logged returns the captured lines of level whose message is msg.
func logged(l *watermill.CaptureLoggerAdapter, level watermill.LogLevel, msg string) []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, m := range l.Captured()[level] {
		if m.Msg == msg {
			out = append(out, m)
		}
	}
	return out
}

// TestIdempotentTwiceIsAConfigurationError (item 3, wiring): the
// idempotent middleware of one consumer wrapped twice around a handler
// (added by hand inside the chain, or a router-level chain plus a
// handler-level one). The inner attempt's claim waited for the outer
// attempt's uncommitted claim of the same key: LockTimeout per attempt,
// ErrInFlight (transient), held, then nacked, forever, with no word of
// the cause. Now the inner middleware sees the outer attempt in the
// context and fails at once with a ConfigurationError that says to wire it
// once: held and logged at ERROR with the hint, never poisoned, the handler
// never called, no claim left.
func TestIdempotentTwiceIsAConfigurationError(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock", LockTimeout: 300 * time.Millisecond,
	}, nil)
	require.NoError(t, err)
	logger := watermill.NewCaptureLogger()
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	h := chainedHold(t, idem, poison, logger, time.Second, idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, writeEffect(msg, "x")
	}))
	id := uuid.Must(uuid.NewV7()).String()
	_, err = h(newMsg(id))
	require.Error(t, err, "held, then given back")
	require.ErrorIs(t, err, inbox.ErrConfiguration, "%v", err)
	require.NotErrorIs(t, err, inbox.ErrInFlight)
	require.ErrorContains(t, err, "twice")
	require.Zero(t, calls.Load())
	require.Empty(t, poison.msgs)
	require.Zero(t, e.processed(id))
	lines := logged(logger, watermill.ErrorLogLevel, "Configuration error: delivery held, not poisoned")
	require.NotEmpty(t, lines)
	require.Contains(t, lines[0].Fields["hint"], "once")
}

// TestChainTwiceHoldsAndRetriesOnce (item 3, wiring): a chain wrapped
// inside another chain (a router-level NewChain plus a handler-level
// NewHandlerMiddleware, each with its own idempotent middleware of one
// consumer). Before, the inner chain held and retried on its own, then the
// outer one again (MaxHold twice, MaxRetries squared), while the nested
// claim waited for itself. Now the inner chain's hold and retry pass
// through (the outer chain holds, retries and poisons), and the nested
// idempotent middleware is a configuration error: the inner chain's logger
// sees nothing, the outer logs the configuration error at ERROR.
func TestChainTwiceHoldsAndRetriesOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	newIdem := func() *inbox.Idempotent {
		idem, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
			Store:    e.store, Consumer: "stock", LockTimeout: 300 * time.Millisecond,
		}, nil)
		require.NoError(t, err)
		return idem
	}
	outerLog, innerLog := watermill.NewCaptureLogger(), watermill.NewCaptureLogger()
	poison := &capture{msgs: make(chan *message.Message, 1)}
	var calls atomic.Int32
	inner := chainedHold(t, newIdem(), poison, innerLog, time.Second, func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, writeEffect(msg, "x")
	})
	h := chainedHold(t, newIdem(), poison, outerLog, time.Second, inner)
	id := uuid.Must(uuid.NewV7()).String()
	_, err := h(newMsg(id))
	require.ErrorIs(t, err, inbox.ErrConfiguration, "%v", err)
	require.Zero(t, calls.Load())
	require.Empty(t, poison.msgs)
	require.Empty(t, innerLog.Captured(), "the inner chain passes through: no hold, retry or poison of its own")
	require.NotEmpty(t, logged(outerLog, watermill.ErrorLogLevel, "Configuration error: delivery held, not poisoned"))
}

// TestPoisonTopicEqualToHandlerTopicNamesTheField (item 3, wiring): ChainConfig.
// PoisonTopic set to the topic the handler consumes. Such a message is
// never published back to its own topic (held instead: no loop), but the
// ERROR said "poisoned message failed again on the poison topic's consumer"
// with a hint about router-level wiring, for a message that was never
// poisoned. Now the ERROR names the field to fix.
func TestPoisonTopicEqualToHandlerTopicNamesTheField(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	poison := &capture{msgs: make(chan *message.Message, 1)}
	idem := sqliteIdempotent(t)
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "orders",
		MaxRetries: 1, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: 50 * time.Millisecond,
	}, logger)
	require.NoError(t, err)
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	defer pubsub.Close()
	runRouter(t, func(router *message.Router) {
		router.AddNoPublisherHandler("orders", "orders", pubsub, func(*message.Message) error { return nil }).AddMiddleware(mw)
	})
	require.NoError(t, pubsub.Publish("orders", message.NewMessage("not-a-uuid", []byte(`{}`))))
	hinted := func() []logLine {
		var out []logLine
		for _, l := range logger.at("error", "") {
			if l.fields["hint"] != nil {
				out = append(out, l)
			}
		}
		return out
	}
	testenv.Eventually(t, 30*time.Second, "an ERROR with a hint", func(o *testenv.Observed) bool {
		return o.Int("hinted errors", len(hinted())) > 0
	})
	require.Empty(t, poison.msgs, "never poisoned onto its own topic")
	lines := hinted()
	require.Contains(t, lines[0].fields["hint"], "ChainConfig.PoisonTopic")
	require.NotContains(t, lines[0].msg, "failed again", "the message was never poisoned")
}

// at returns, under the lock, the lines of level whose message is msg
// (any message when msg is "").
func (l *captureLogger) at(level, msg string) []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logLine
	for _, x := range l.lines {
		if x.level == level && (msg == "" || x.msg == msg) {
			out = append(out, x)
		}
	}
	return out
}

// sqliteIdempotent is the idempotent middleware of consumer "stock" on a
// SQLite database of the test's own (database/sql).
func sqliteIdempotent(t *testing.T) *inbox.Idempotent {
	t.Helper()
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: mustBeginner(inbox.NewStdBeginner(testenv.SQLiteDB(t))),
		Store: mustSQLiteStore(t), Consumer: "stock"}, nil)
	require.NoError(t, err)
	return idem
}

func mustSQLiteStore(t *testing.T) *processedstore.Store {
	t.Helper()
	s, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite})
	require.NoError(t, err)
	return s
}

// proxiedBeginner is a beginner whose connections go through a fault proxy.
type proxiedBeginner struct {
	name     string
	beginner inbox.TxBeginner
	store    *processedstore.Store
	proxy    *faultproxy.Proxy
	// sleepQ is a statement that sleeps on the attempt's transaction (2-5 s).
	sleepQ  string
	effects func(id string) int
	insert  string
}

// TestHandlerEndedTxIsPoisonedNotSilentlyLost (item 3, wiring): a
// handler that commits the attempt's transaction itself, then returns a
// message (router or outbox). The middleware's outbox write or COMMIT then
// fails with pgx.ErrTxClosed / sql.ErrTxDone. Before, that was ordinary:
// the retry found the claim the handler had committed, acked it as a
// duplicate, and the produced message was never published nor written:
// lost, with no poisoned message to show for it. Now a transaction the
// handler ended (the message context still live) is permanent, reason
// "handler_ended_tx": poisoned once at once, so the operator sees it; a
// handler that rolled back instead is poisoned the same way, without
// retries that would only repeat it.
func TestHandlerEndedTxIsPoisonedNotSilentlyLost(t *testing.T) {
	t.Parallel()
	e, ob := newOutboxEnv(t)
	for _, b := range beginnersUnderTest(t, e.schema) {
		for _, withOutbox := range []bool{false, true} {
			for _, commit := range []bool{true, false} {
				name := fmt.Sprintf("%s/outbox=%v/commit=%v", b.name, withOutbox, commit)
				t.Run(name, func(t *testing.T) {
					cfg := inbox.Config{Beginner: b.beginner, Store: e.store, Consumer: "h11-" + name}
					if withOutbox {
						cfg.Outbox, cfg.OutboxTopic = ob, "out"
					}
					idem, err := inbox.NewIdempotent(cfg, nil)
					require.NoError(t, err)
					poison := &capture{msgs: make(chan *message.Message, 3)}
					var calls atomic.Int32
					h := chainedHold(t, idem, poison, nil, time.Minute, func(msg *message.Message) ([]*message.Message, error) {
						calls.Add(1)
						if err := writeEffectQ(msg, name); err != nil {
							return nil, err
						}
						endTx(t, msg, commit)
						out, err := marshaler.NewMessage("stock.reserved", map[string]string{"e": msg.UUID})
						require.NoError(t, err)
						return []*message.Message{out}, nil
					})
					id := newID()
					produced, err := h(newMsg(id))
					require.NoError(t, err, "poisoned = acked")
					require.Empty(t, produced, "nothing returned from a failed attempt")
					require.EqualValues(t, 1, calls.Load(), "permanent: not retried")
					require.Len(t, poison.msgs, 1, "poisoned once, visible")
					pm := <-poison.msgs
					require.Equal(t, "permanent", pm.Metadata.Get(inbox.MetadataPoisonClass))
					require.Contains(t, pm.Metadata.Get("reason_poisoned"), "ended the attempt's transaction")
					require.Zero(t, b.inUse(), "no connection stays acquired")
				})
			}
		}
	}
}

// TestTxKeptAfterTheHandlerReturnedIsRefused (item 3, wiring): a
// handler that keeps the attempt's transaction (pgx.Tx, *sql.Tx or the
// querier) and uses it after it returned, e.g. from the next message's
// handler. Every use is refused (pgx.ErrTxClosed / sql.ErrTxDone), nothing
// lands in the later attempt's transaction, and no connection stays
// acquired: for every beginner.
func TestTxKeptAfterTheHandlerReturnedIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, b := range beginnersUnderTest(t, e.schema) {
		t.Run(b.name, func(t *testing.T) {
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: b.beginner, Store: e.store, Consumer: "kept-" + b.name}, nil)
			require.NoError(t, err)
			var kept sqldb.Querier
			var keptPgx pgx.Tx
			var keptSQL *sql.Tx
			var lateErrs []error
			h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if kept != nil { // the second message: use the first one's transaction
					_, err := kept.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'late')`, msg.UUID)
					lateErrs = append(lateErrs, err)
					if keptPgx != nil {
						_, err = keptPgx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'late')`, msg.UUID)
						lateErrs = append(lateErrs, err)
					}
					if keptSQL != nil {
						_, err = keptSQL.ExecContext(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'late')`, msg.UUID)
						lateErrs = append(lateErrs, err)
					}
					return nil, writeEffectQ(msg, "second")
				}
				kept, _ = inbox.QuerierFromContext(msg.Context())
				keptPgx, _ = inbox.PgxTxFromContext(msg.Context())
				keptSQL, _ = inbox.SQLTxFromContext(msg.Context())
				return nil, writeEffectQ(msg, "first")
			})
			first, second := newID(), newID()
			_, err = h(newMsg(first))
			require.NoError(t, err)
			_, err = h(newMsg(second))
			require.NoError(t, err)
			require.NotEmpty(t, lateErrs)
			for _, err := range lateErrs {
				require.True(t, errors.Is(err, pgx.ErrTxClosed) || errors.Is(err, sql.ErrTxDone), "refused: %v", err)
			}
			require.Equal(t, 1, e.effects(first))
			require.Equal(t, 1, e.effects(second), "nothing of the kept transaction in the later attempt")
			require.Zero(t, e.count(`SELECT count(*) FROM effect WHERE note = 'late'`))
			require.Zero(t, b.inUse())
		})
	}
}

// runRouter starts a router on the test's broker, lets setup add handlers,
// and closes it when the test ends (or when the returned stop is called).
func runRouter(t *testing.T, setup func(r *message.Router)) (stop func()) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	setup(router)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(context.Background())
	}()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	var stopped atomic.Bool
	stop = func() {
		if stopped.CompareAndSwap(false, true) {
			_ = router.Close()
			<-done
		}
	}
	t.Cleanup(stop)
	return stop
}

// ordersChain runs, until the test ends, a router whose handler h
// consumes "orders" from an in-process pubsub behind the whole chain of
// idem: dead letters to "orders.dlq" through the publisher poison returns
// (given the pubsub), one retry, holds of at most maxHold. It returns the
// pubsub.
func ordersChain(t *testing.T, idem *inbox.Idempotent, logger watermill.LoggerAdapter, maxHold time.Duration,
	poison func(*gochannel.GoChannel) message.Publisher, h message.NoPublishHandlerFunc) *gochannel.GoChannel {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pubsub.Close() })
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison(pubsub), PoisonTopic: "orders.dlq",
		MaxRetries: 1, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, MaxHold: maxHold,
	}, logger)
	require.NoError(t, err)
	runRouter(t, func(router *message.Router) {
		router.AddNoPublisherHandler("orders", "orders", pubsub, h).AddMiddleware(mw)
	})
	return pubsub
}

// loopingPoison publishes each poisoned copy back to the handler's own
// topic, as a dead-letter queue that is the consumer's own queue does.
type loopingPoison struct {
	pubsub *gochannel.GoChannel
	topic  string
	n      atomic.Int32
}

func (p *loopingPoison) Publish(_ string, msgs ...*message.Message) error {
	p.n.Add(int32(len(msgs)))
	return p.pubsub.Publish(p.topic, msgs...)
}

func (p *loopingPoison) Close() error { return nil }

// A dead letter whose destination routes back to the consumer (here every
// poisoned copy is published to the handler's own topic) is poisoned twice
// (the first return could be a redrive by hand): when it comes back again
// and fails again it is held with an ERROR naming the misrouting, not
// dead-lettered again. It was re-poisoned on every return, for ever (2,167
// times in 6 s for one message on RabbitMQ).
func TestDeadLetterRoutedBackToItsConsumerIsHeldAfterItsSecondPoisoning(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	idem := sqliteIdempotent(t)
	var poison *loopingPoison
	pubsub := ordersChain(t, idem, logger, 50*time.Millisecond, func(ps *gochannel.GoChannel) message.Publisher {
		poison = &loopingPoison{pubsub: ps, topic: "orders"}
		return poison
	}, func(*message.Message) error { return nil })
	require.NoError(t, pubsub.Publish("orders", message.NewMessage("not-a-uuid", []byte(`{}`)))) // rejected: permanent
	testenv.Eventually(t, 30*time.Second, "the returned dead letter held with an ERROR", func(o *testenv.Observed) bool {
		return o.Int("errors", len(logger.at("error", "Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held"))) > 0
	})
	require.EqualValues(t, 2, poison.n.Load(), "dead-lettered twice, not on every return")
	line := logger.at("error", "Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held")[0]
	require.Contains(t, line.fields["hint"], "idem dlq redrive")
}

// A dead letter poisoned three times already, the last time two hours ago,
// redriven with its poison headers kept (by hand, on a transport idem dlq
// does not serve), that fails again goes back to the dead letters: only a
// copy back within 10 minutes of a second poisoning is taken for a routing
// loop and held.
func TestDeadLetterRedrivenWithItsHeadersLaterIsPoisonedAgain(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	poison := &capture{msgs: make(chan *message.Message, 1)}
	idem := sqliteIdempotent(t)
	pubsub := ordersChain(t, idem, logger, 50*time.Millisecond, func(*gochannel.GoChannel) message.Publisher { return poison },
		func(*message.Message) error { return nil })
	redriven := message.NewMessage("not-a-uuid", []byte(`{}`)) // rejected: permanent
	redriven.Metadata.Set(wmw.ReasonForPoisonedKey, "an earlier failure")
	redriven.Metadata.Set(wmw.PoisonedTopicKey, "orders")
	redriven.Metadata.Set(inbox.MetadataPoisonedAt, time.Now().Add(-2*time.Hour).UTC().Format(time.RFC3339Nano))
	redriven.Metadata.Set(inbox.MetadataPoisonCount, "3")
	require.NoError(t, pubsub.Publish("orders", redriven))
	select {
	case m := <-poison.msgs:
		require.Equal(t, "not-a-uuid", m.UUID)
		require.NotEqual(t, "an earlier failure", m.Metadata.Get(wmw.ReasonForPoisonedKey), "poisoned with its new reason")
		require.Equal(t, "4", m.Metadata.Get(inbox.MetadataPoisonCount))
	case <-time.After(30 * time.Second): // a hang guard, not a measurement
		t.Fatal("the redriven copy that failed again was not poisoned again")
	}
	require.Empty(t, logger.at("error", "Dead letter came back to the topic it was dead-lettered from: not re-poisoned, held"))
}
