package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// docs/guarantees.md: "A failure of the attempt's own connection is the
// database's" (held, not poisoned); handler_ended_tx is for a handler that
// ended the transaction itself. Here the attempt's connection is cut (KILL,
// as a proxy would), the server rolls the claim back, and a competing worker
// (another process of the same consumer) claims and processes the event.
// The first attempt's handler returns the connection's error: it must not be
// poisoned as handler_ended_tx (its handler ended nothing).
func TestConnectionCutWhileAnotherWorkerProcessesIsNotHandlerEndedTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetMariaDB, 4)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, tg.DB))
	tg.Exec(t, `CREATE TABLE effect (event_id VARCHAR(36) NOT NULL)`)
	newIdem := func() *inbox.Idempotent {
		idem, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "h10-cut", Classifier: mysqlerr.Classify,
		}, nil)
		require.NoError(t, err)
		return idem
	}
	competitor := chainedHold(t, newIdem(), &capture{msgs: make(chan *message.Message, 4)}, nil, time.Minute,
		func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.SQLTxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?)`, msg.UUID)
			return nil, err
		})
	id := uuid.Must(uuid.NewV7()).String()
	var herr error
	calls := 0
	idem := newIdem()
	poison := &capture{msgs: make(chan *message.Message, 4)}
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
		MaxRetries: 0, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond,
		MaxHold: time.Millisecond,
	}, nil)
	require.NoError(t, err)
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		calls++
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		if calls > 1 {
			_, err := tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?)`, msg.UUID)
			return nil, err
		}
		var connID int64
		if err := tx.QueryRowContext(msg.Context(), `SELECT CONNECTION_ID()`).Scan(&connID); err != nil {
			return nil, err
		}
		// The proxy cuts the connection: the server rolls the claim back.
		_, err := tg.Std.ExecContext(ctx, `KILL CONNECTION `+itoa(connID))
		require.NoError(t, err)
		// Another worker, handed the same event, claims and processes it.
		_, err = competitor(newMsg(id))
		require.NoError(t, err)
		_, herr = tx.ExecContext(msg.Context(), `INSERT INTO effect VALUES (?)`, msg.UUID)
		require.Error(t, herr)
		return nil, herr
	})
	_, err = h(newMsg(id))
	t.Logf("handler error: %v; chain: %v", herr, err)
	select {
	case m := <-poison.msgs:
		t.Fatalf("a cut connection (handler error %v) was poisoned: %v", herr, m.Metadata)
	default:
	}
	if err != nil {
		require.NotContains(t, err.Error(), "handler_ended_tx")
		require.False(t, strings.Contains(err.Error(), "ended the attempt's transaction itself"), "cut connection reported as handler_ended_tx: %v", err)
	}
}

func itoa(n int64) string {
	b := []byte{}
	if n == 0 {
		return "0"
	}
	for n > 0 {
		b = append([]byte{byte('0' + n%10)}, b...)
		n /= 10
	}
	return string(b)
}
