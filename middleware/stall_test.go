package middleware_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
)

type outcomeLog struct {
	mu  sync.Mutex
	got []middleware.Outcome
}

func (l *outcomeLog) RecordOutcome(o middleware.Observation) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, o.Outcome)
}

func (l *outcomeLog) count(o middleware.Outcome) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, g := range l.got {
		if g == o {
			n++
		}
	}
	return n
}

// A database that stops answering with its connection left open (here a
// proxy that holds every byte: a partition, a paused VM) blocks the
// attempt's COMMIT with no error to hold or retry. The consumer reports it:
// logged at ERROR and recorded as OutcomeStalled while no attempt finishes;
// once the database answers again the event is applied once and acked, and
// the reports stop. Before: no log line, no count, for as long as it lasted
// (95 s seen by a new user).
func TestConsumerReportsAttemptsStalledOnAHungDatabase(t *testing.T) {
	defer inbox.SetStallAfter(time.Second)()
	e := newConsumerEnv(t)
	cfg := e.pool.Config().Copy()
	proxy, err := faultproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	require.NoError(t, err)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	hungPool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(hungPool.Close)
	t.Cleanup(func() { _ = proxy.Close() }) // first: a hung COMMIT ends, its connection goes back

	rec := &outcomeLog{}
	logger := watermill.NewCaptureLogger()
	ccfg := e.config("stock")
	ccfg.DB, ccfg.Recorder = idempotency.Pgx(hungPool), rec
	c, err := middleware.NewConsumer(ccfg, logger)
	require.NoError(t, err)
	inside, proceed := make(chan struct{}), make(chan struct{})
	h, err := door.Wrap(c, "reserve", func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		close(inside)
		<-proceed
		return nil, nil
	})
	require.NoError(t, err)

	done := make(chan error, 1)
	event := newEvent(t)
	go func() { _, err := h(event); done <- err }()
	<-inside
	proxy.Hang() // the COMMIT now waits on a connection that never answers
	close(proceed)

	testenv.Eventually(t, 30*time.Second, "a stall recorded while the database does not answer",
		func(*testenv.Observed) bool { return rec.count(middleware.OutcomeStalled) > 0 })
	stalled := 0
	for _, entry := range logger.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(entry.Msg, "Attempts stalled") {
			stalled++
		}
	}
	require.Positive(t, stalled, "the stall is logged at ERROR")
	select {
	case err := <-done:
		t.Fatalf("the attempt ended while the database hung: %v", err)
	default:
	}

	proxy.Resume()
	select {
	case err := <-done:
		require.NoError(t, err, "applied and acked once the database answers")
	case <-time.After(60 * time.Second):
		t.Fatal("the attempt did not end after the database answered again")
	}
	require.Equal(t, 1, e.effects(t))
	require.Equal(t, 1, rec.count(middleware.OutcomeProcessed))
}
