package inbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// msg.UUID is parsed with the marshaler's strict rules (marshaler.ParseEventID):
// uuid.Parse accepts any 38-character string whose first and last characters
// are arbitrary, and such an id is refused before any SQL runs.
func TestEventIDIsParsedStrictly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var calls atomic.Int32
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
	for _, id := range []string{"x" + E1 + "y", "(" + E1 + ")", "{" + E1 + ")", " " + E1 + " ", "urn:uuix:" + E1} {
		_, err := h(newMsg(id))
		require.ErrorIs(t, err, inbox.ErrInvalidEventID, id)
		require.True(t, inbox.IsPermanent(err), id)
	}
	require.EqualValues(t, 0, calls.Load())
	require.Equal(t, 0, e.count(`SELECT count(*) FROM processed_event`))
}

// evMsg is a message of event id with a name and a payload.
func evMsg(id, name, payload string) *message.Message {
	m := message.NewMessage(id, []byte(payload))
	m.Metadata.Set(marshaler.MetadataEventName, name)
	return m
}

// An event id reused for another event (other name or payload) is a
// conflict: permanent (ErrEventIDReused), the handler not called, logged at
// error with both event names, counted as OutcomeConflict, and poisoned once
// through the chain. The same event again stays a plain duplicate, on every
// beginner and database.
func TestEventIDReusedIsAConflict(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		store, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect})
		require.NoError(t, err)
		require.NoError(t, store.Migrate(ctx, tg.DB))
		var beginner inbox.TxBeginner
		if tg.Pgx != nil {
			beginner = mustBeginner(inbox.NewPgxBeginner(tg.Pgx, inbox.PgxBeginnerConfig{}))
		} else {
			beginner = mustBeginner(inbox.NewStdBeginner(tg.Std))
		}
		logger := &captureLogger{}
		rec := &recorder{}
		idem, err := inbox.NewIdempotent(inbox.Config{
			Beginner: beginner, Store: store, Consumer: "stock", Recorder: rec,
		}, logger)
		require.NoError(t, err)
		var calls atomic.Int32
		h := idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})

		_, err = h(evMsg(E1, "order.placed", `{"order_id":1}`))
		require.NoError(t, err)
		_, err = h(evMsg(E1, "order.placed", `{"order_id":1}`))
		require.NoError(t, err, "the same event again is a duplicate")
		require.Equal(t, 1, rec.Count(inbox.OutcomeDuplicate))

		for _, other := range []*message.Message{
			evMsg(E1, "order.cancelled", `{"order_id":1}`), // another name
			evMsg(E1, "order.placed", `{"order_id":2}`),    // another payload
			evMsg(E1, "order.placed", `{"order_id": 1}`),   // other bytes: not the payload that was applied
		} {
			_, err = h(other)
			require.ErrorIs(t, err, inbox.ErrEventIDReused)
			require.True(t, inbox.IsPermanent(err))
			var pe *inbox.PermanentError
			require.ErrorAs(t, err, &pe)
			require.Equal(t, "event_id_reused", pe.Reason)
		}
		require.EqualValues(t, 1, calls.Load())
		require.Equal(t, 3, rec.Count(inbox.OutcomeConflict))
		require.Equal(t, 1, rec.Count(inbox.OutcomeDuplicate))

		logger.mu.Lock()
		var errLines []logLine
		for _, l := range logger.lines {
			if l.level == "error" {
				errLines = append(errLines, l)
			}
		}
		logger.mu.Unlock()
		require.Len(t, errLines, 3)
		require.Equal(t, "order.cancelled", errLines[0].fields["event_name"])
		require.Equal(t, "order.placed", errLines[0].fields["stored_event_name"])
		require.Contains(t, fmt.Sprint(errLines[0].fields["error"]), `"order.placed"`)
		require.Contains(t, fmt.Sprint(errLines[0].fields["error"]), `"order.cancelled"`)

		// A row written without a fingerprint (before the migration, or
		// with verification off) keeps working: a plain duplicate.
		off, err := inbox.NewIdempotent(inbox.Config{
			Beginner: beginner, Store: store, Consumer: "stock", DisablePayloadVerification: true,
		}, nil)
		require.NoError(t, err)
		hOff := off.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})
		_, err = hOff(evMsg(E2, "order.placed", `{"order_id":7}`))
		require.NoError(t, err)
		require.EqualValues(t, 2, calls.Load())
		_, err = h(evMsg(E2, "order.shipped", `{}`))
		require.NoError(t, err, "no fingerprint stored: a duplicate")
		// With verification off, a reused id is acked as a duplicate (the
		// old behaviour), and nothing is applied.
		_, err = hOff(evMsg(E1, "order.cancelled", `{}`))
		require.NoError(t, err)
		require.EqualValues(t, 2, calls.Load())

		// Through the chain: poisoned once, then acked.
		poison := &capture{msgs: make(chan *message.Message, 10)}
		chain, err := inbox.NewChain(inbox.ChainConfig{
			Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "stock.poison",
			MaxRetries: 3, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
		}, nil)
		require.NoError(t, err)
		var hc message.HandlerFunc = func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		}
		for i := len(chain) - 1; i >= 0; i-- {
			hc = chain[i](hc)
		}
		_, err = hc(evMsg(E1, "order.refunded", `{"order_id":1}`))
		require.NoError(t, err, "poisoned and acked")
		require.Len(t, poison.msgs, 1)
		p := <-poison.msgs
		require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "event_id reused")
		require.Equal(t, "1", p.Metadata.Get(inbox.MetadataAttempt), "permanent: not retried")
		require.EqualValues(t, 2, calls.Load())
	})
}
