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
)

// docs/consumer.md / guarantees (d523f3e): "a statement of the attempt's
// transaction cancelled by the handler's own deadline stays held like
// statement_timeout". On SQLite the cancel is sqlite3_interrupt, which
// rolls the whole transaction back (the claim's savepoint with it): the
// handler ended nothing, yet endedByHandler finds the savepoint gone and
// poisons the delivery as handler_ended_tx.
func TestHandlerDeadlineInterruptOnSQLiteIsNotHandlerEndedTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetSQLite, 2)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect, Horizon: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx, tg.DB))
	tg.Exec(t, `CREATE TABLE effect (n INTEGER NOT NULL)`)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewStdBeginner(tg.Std)), Store: store, Consumer: "h10-int",
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 4)}
	mw, err := inbox.NewHandlerMiddleware(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "poison",
		MaxRetries: 0, InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond,
		MaxHold: time.Millisecond,
	}, nil)
	require.NoError(t, err)
	var herr error
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.SQLTxFromContext(msg.Context())
		c, cancel := context.WithTimeout(msg.Context(), 100*time.Millisecond)
		defer cancel()
		// Endless: only the handler's own deadline ends it.
		_, herr = tx.ExecContext(c, `INSERT INTO effect WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM r) SELECT x FROM r`)
		return nil, herr
	})
	_, err = h(newMsg(uuid.Must(uuid.NewV7()).String()))
	t.Logf("handler error: %v; chain: %v", herr, err)
	select {
	case m := <-poison.msgs:
		require.False(t, strings.Contains(m.Metadata.Get("reason_poisoned"), "ended the attempt's transaction itself"),
			"the handler's own deadline (interrupt) was poisoned as handler_ended_tx: %s", m.Metadata.Get("reason_poisoned"))
	default:
	}
	if err != nil {
		require.NotContains(t, err.Error(), "ended the attempt's transaction itself")
	}
}
