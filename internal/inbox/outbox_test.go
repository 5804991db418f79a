package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

const childEnv = "IDEMPOTENCY_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(runChild(mode))
	}
	os.Exit(m.Run())
}

// runChild is the consumer process of the crash tests: it processes one
// event with the outbox configured and SIGKILLs itself at the named point.
func runChild(mode string) int {
	ctx := context.Background()
	schema := os.Getenv("CHILD_SCHEMA")
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ob, _ := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, nil)
	store, _ := processedstore.NewStore(processedstore.Config{})
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner:    mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Store:       store,
		Consumer:    "order-confirmation",
		Outbox:      ob,
		OutboxTopic: "emails",
	}, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	crashpoint.Set(func(name string) {
		if name == mode {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	})
	h := idem.Middleware(producingHandler)
	if _, err := h(newMsg(os.Getenv("CHILD_EVENT"))); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	return 0
}

// producingHandler writes an effect and produces one e-mail request whose
// event_id is derived deterministically from nothing but a fresh UUIDv7: the
// outbox fixes it at write time.
func producingHandler(msg *message.Message) ([]*message.Message, error) {
	if err := writeEffect(msg, "confirmed"); err != nil {
		return nil, err
	}
	out, err := marshaler.NewMessage("email.requested", map[string]string{"order_event": msg.UUID})
	if err != nil {
		return nil, err
	}
	return []*message.Message{out}, nil
}

// runChildProcess re-executes the test binary as a consumer that dies at point.
func runChildProcess(t *testing.T, schema, eventID, point string) error {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+point, "CHILD_SCHEMA="+schema, "CHILD_EVENT="+eventID)
	out, err := cmd.CombinedOutput()
	if len(out) > 0 {
		t.Logf("child output: %s", out)
	}
	return err
}

func requireKilled(t *testing.T, err error) {
	t.Helper()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled(), "child must die by signal: %v", err)
	require.Equal(t, syscall.SIGKILL, ws.Signal())
}

func newOutboxEnv(t *testing.T) (*env, *outbox.Outbox) {
	e := newEnv(t)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool)}, nil)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(context.Background()))
	return e, ob
}

func (e *env) outboxRows() int {
	return e.count(`SELECT count(*) FROM outbox`)
}

// Returned messages and context-published ones are written to the outbox in
// the attempt's transaction: none reach the router, a rollback writes none.
func TestOutboxWritesProducedMessagesInTheAttemptTx(t *testing.T) {
	t.Parallel()
	e, ob := newOutboxEnv(t)
	fail := true
	h := e.mw(e.pool, func(c *inbox.Config) {
		c.Outbox = ob
		c.OutboxTopic = "emails"
	})(func(msg *message.Message) ([]*message.Message, error) {
		pub, ok := inbox.PublisherFromContext(msg.Context())
		require.True(t, ok)
		side, err := marshaler.NewMessage("audit.logged", map[string]string{"e": msg.UUID})
		require.NoError(t, err)
		require.NoError(t, pub.Publish("audit", side))
		out, err := producingHandler(msg)
		if err != nil {
			return nil, err
		}
		if fail {
			fail = false
			return out, errors.New("first attempt fails after producing")
		}
		return out, nil
	})
	_, err := h(newMsg(E1))
	require.Error(t, err)
	require.Equal(t, 0, e.outboxRows(), "a rolled back attempt writes no outbox row")
	produced, err := h(newMsg(E1))
	require.NoError(t, err)
	require.Empty(t, produced, "with an outbox nothing goes back to the router")
	require.Equal(t, 2, e.outboxRows())
	_, err = h(newMsg(E1)) // duplicate: produces nothing more
	require.NoError(t, err)
	require.Equal(t, 2, e.outboxRows())

	// Without Config.Outbox, no context publisher; returned messages go back.
	plain := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		_, ok := inbox.PublisherFromContext(msg.Context())
		require.False(t, ok)
		return producingHandler(msg)
	})
	produced, err = plain(newMsg(E2))
	require.NoError(t, err)
	require.Len(t, produced, 1)
}

// The consumer is SIGKILLed after its commit, before anything could publish
// the produced message: the relay still delivers it, with the event_id it was
// written with, and its own consumer applies it once even when re-sent.
func TestOutboxSurvivesCrashAfterCommit(t *testing.T) {
	t.Parallel()
	e, ob := newOutboxEnv(t)
	requireKilled(t, runChildProcess(t, e.schema, E1, crashpoint.AfterCommit))
	require.Equal(t, 1, e.processed(E1), "the child committed before dying")
	require.Equal(t, 1, e.outboxRows())

	// The restarted consumer gets the redelivery: a duplicate, nothing new.
	require.NoError(t, runChildProcess(t, e.schema, E1, "none"))
	require.Equal(t, 1, e.outboxRows())
	require.Equal(t, 1, e.effects(E1))

	var outboxUUID string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT event_id FROM outbox`).Scan(&outboxUUID))
	logger := watermill.NopLogger{}
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	relay, err := ob.NewRelay(broker, outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = relay.Run(ctx) }()
	defer relay.Close()
	emails, err := broker.Subscribe(ctx, "emails")
	require.NoError(t, err)
	var got *message.Message
	select {
	case got = <-emails:
		got.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the produced message was never relayed")
	}
	require.Equal(t, "email.requested", marshaler.EventName(got))

	// Its consumer (the mailer) deduplicates re-sends of the same event_id.
	mailer := e.mw(e.pool, func(c *inbox.Config) { c.Consumer = "mailer" })(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeEffect(msg, "mail")
	})
	for i := 0; i < 2; i++ { // the relay's at-least-once re-send
		_, err := mailer(got.Copy())
		require.NoError(t, err)
	}
	require.Equal(t, 1, e.effects(got.UUID))
	require.Equal(t, outboxUUID, got.UUID, "the relayed message keeps the event_id written in the outbox")
}

// C01 variant D at the database level: the consumer is SIGKILLed after the
// claim and before COMMIT; the restart processes the event once.
func TestKilledBeforeCommitIsProcessedOnRestart(t *testing.T) {
	t.Parallel()
	e, _ := newOutboxEnv(t)
	requireKilled(t, runChildProcess(t, e.schema, E1, crashpoint.AfterClaim))
	require.Eventually(t, func() bool { return e.processed(E1) == 0 }, 10*time.Second, 20*time.Millisecond,
		"the killed transaction's claim must vanish")
	require.NoError(t, runChildProcess(t, e.schema, E1, "none"))
	require.Equal(t, 1, e.processed(E1))
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 1, e.outboxRows())
}
