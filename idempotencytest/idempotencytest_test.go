package idempotencytest_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// fakeTB records what the helpers report.
type fakeTB struct {
	mu   sync.Mutex
	errs []string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, fmt.Sprintf(format, args...))
}

func (f *fakeTB) all() string { return strings.Join(f.errs, "\n") }

var _ idempotencytest.TB = (*testing.T)(nil)

type fixture struct {
	pool *pgxpool.Pool
	idem *inbox.Idempotent
}

func newFixture(t *testing.T, consumer string) *fixture {
	t.Helper()
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	store, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, sqldb.Pgx(pool)))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (event_id uuid NOT NULL)`)
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
		Consumer: consumer,
	}, nil)
	require.NoError(t, err)
	return &fixture{pool: pool, idem: idem}
}

// handler writes one effect row: in the attempt's transaction when there is
// one, otherwise straight on the pool (the broken set-up).
func (f *fixture) handler(msg *message.Message) error {
	if tx, ok := inbox.PgxTxFromContext(msg.Context()); ok {
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID)
		return err
	}
	_, err := f.pool.Exec(msg.Context(), `INSERT INTO effect VALUES ($1)`, msg.UUID)
	return err
}

func (f *fixture) effects(ctx context.Context, msg *message.Message) (int, error) {
	var n int
	err := f.pool.QueryRow(ctx, `SELECT count(*) FROM effect WHERE event_id = $1`, msg.UUID).Scan(&n)
	return n, err
}

func (f *fixture) subject(mw ...message.HandlerMiddleware) idempotencytest.Subject {
	return idempotencytest.Subject{
		Handler:    idempotencytest.NoPublish(f.handler),
		Middleware: mw,
		Effects:    f.effects,
	}
}

func newMsg() *message.Message {
	return message.NewMessage(uuid.Must(uuid.NewV7()).String(), []byte(`{}`))
}

// passthrough stands for a chain without the idempotent middleware.
func passthrough(h message.HandlerFunc) message.HandlerFunc { return h }

func TestDeliverTwice(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "c")
	r := idempotencytest.DeliverTwice(t, f.subject(f.idem.Middleware), newMsg())
	require.Equal(t, idempotencytest.Report{Deliveries: 2, Calls: 1, Effects: 1}, r)

	tb := &fakeTB{}
	r = idempotencytest.DeliverTwice(tb, f.subject(passthrough), newMsg())
	require.Equal(t, 2, r.Calls)
	require.Equal(t, 2, r.Effects)
	require.Contains(t, tb.all(), "handler entered 2 times")
	require.Contains(t, tb.all(), "2 effects after 2 deliveries")
}

func TestDeliverConcurrently(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "c")
	r := idempotencytest.DeliverConcurrently(t, f.subject(f.idem.Middleware), newMsg(), 8)
	require.Equal(t, 8, r.Deliveries)
	require.Equal(t, 1, r.Calls)
	require.Equal(t, 1, r.Effects)

	tb := &fakeTB{}
	r = idempotencytest.DeliverConcurrently(tb, f.subject(passthrough), newMsg(), 4)
	require.Equal(t, 4, r.Effects)
	require.Contains(t, tb.all(), "4 effects after 4 deliveries")

	tb = &fakeTB{}
	idempotencytest.DeliverConcurrently(tb, f.subject(f.idem.Middleware), newMsg(), 1)
	require.Contains(t, tb.all(), "want ≥ 2")
}

func TestSubjectValidation(t *testing.T) {
	t.Parallel()
	f := &fixture{}
	for name, s := range map[string]idempotencytest.Subject{
		"Subject.Handler":    {Middleware: []message.HandlerMiddleware{passthrough}, Effects: f.effects},
		"Subject.Middleware": {Handler: idempotencytest.NoPublish(f.handler), Effects: f.effects},
		"Subject.Effects":    {Handler: idempotencytest.NoPublish(f.handler), Middleware: []message.HandlerMiddleware{passthrough}},
	} {
		tb := &fakeTB{}
		idempotencytest.DeliverTwice(tb, s, newMsg())
		require.Contains(t, tb.all(), name)
	}
}

// A panic that escapes the chain is reported as a failed delivery.
func TestPanicIsReported(t *testing.T) {
	t.Parallel()
	f := newFixture(t, "c")
	s := f.subject(f.idem.Middleware)
	s.Handler = func(*message.Message) ([]*message.Message, error) { panic("boom") }
	tb := &fakeTB{}
	r := idempotencytest.DeliverTwice(tb, s, newMsg())
	require.Len(t, r.Errors, 2)
	require.Contains(t, tb.all(), "panic: boom")
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}
