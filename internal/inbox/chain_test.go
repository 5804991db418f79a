package inbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/metrics"
)

// capture publishes nothing anywhere but records what reaches the poison topic.
type capture struct {
	msgs chan *message.Message
}

func (c *capture) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		c.msgs <- m
	}
	return nil
}
func (c *capture) Close() error { return nil }

func TestChainPoisonRetryAndMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	prom, err := metrics.NewPrometheus(metrics.Config{Registerer: reg})
	require.NoError(t, err)
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store,
		Consumer: "stock",
		Recorder: prom,
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 10)}
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent:      idem,
		PoisonPublisher: poison,
		PoisonTopic:     "stock.poison",
		MaxRetries:      2,
		InitialInterval: time.Millisecond,
		MaxInterval:     time.Millisecond,
		// No time bound: the infra case below ends its hold by ending the
		// message context, so a loaded machine cannot race it.
		MaxHold: time.Hour,
	}, nil)
	require.NoError(t, err)

	infraCtx, stopInfra := context.WithCancel(context.Background())
	defer stopInfra()
	calls := map[string]*atomic.Int32{}
	for _, k := range []string{"permanent", "flaky", "infra", "ok"} {
		calls[k] = &atomic.Int32{}
	}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		kind := msg.Metadata.Get("kind")
		calls[kind].Add(1)
		if err := writeEffect(msg, kind); err != nil {
			return nil, err
		}
		switch kind {
		case "permanent":
			return nil, inbox.Permanent(errors.New("order unknown"))
		case "flaky":
			return nil, errors.New("provider said 500")
		case "infra":
			if calls[kind].Load() == 2 {
				stopInfra() // the second held attempt: shutdown, give it back
			}
			return nil, &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
		}
		return nil, nil
	}
	var h message.HandlerFunc = handler
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	run := func(kind, id string) error {
		m := newMsg(id)
		m.Metadata.Set("kind", kind)
		if kind == "infra" {
			m.SetContext(infraCtx)
		}
		_, err := h(m)
		return err
	}

	// Permanent: to the poison topic on the first attempt, acked (nil).
	require.NoError(t, run("permanent", "01906dbc-ad00-70a1-8a1b-000000000001"))
	require.EqualValues(t, 1, calls["permanent"].Load())
	p := <-poison.msgs
	require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "order unknown")

	// Ordinary handler error: retried MaxRetries times, then poisoned.
	require.NoError(t, run("flaky", "01906dbc-ad00-70a1-8a1b-000000000002"))
	require.EqualValues(t, 3, calls["flaky"].Load())
	p = <-poison.msgs
	require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "provider said 500")

	// Infrastructure error: held (re-run in place, not by Retry) until the
	// message context ends, never poisoned, then returned (nack).
	err = run("infra", "01906dbc-ad00-70a1-8a1b-000000000003")
	require.Error(t, err)
	require.True(t, inbox.IsTransient(err))
	require.EqualValues(t, 2, calls["infra"].Load(), "held and re-run in place")
	select {
	case m := <-poison.msgs:
		t.Fatalf("an infrastructure error reached the poison topic: %v", m.Metadata)
	default:
	}

	// Malformed: rejected, poisoned, handler never called.
	bad := message.NewMessage("x", []byte("not json"))
	bad.Metadata.Set("idempotency_malformed", "true")
	bad.Metadata.Set("idempotency_malformed_reason", "envelope: not a JSON object")
	_, err = h(bad)
	require.NoError(t, err)
	p = <-poison.msgs
	require.Contains(t, p.Metadata.Get(wmw.ReasonForPoisonedKey), "not a JSON object")
	require.Equal(t, "not json", string(p.Payload))

	require.NoError(t, run("ok", E1))
	require.NoError(t, run("ok", E1))

	count := func(outcome string) float64 {
		return testutil.ToFloat64(counterVec(t, reg, "idempotency_attempts_total", map[string]string{"consumer": "stock", "outcome": outcome}))
	}
	require.EqualValues(t, 1, count("processed"))
	require.EqualValues(t, 1, count("duplicate"))
	require.EqualValues(t, 1+3+int(calls["infra"].Load()), count("failed"))
	require.EqualValues(t, 1, count("rejected"))
	require.Equal(t, 1, e.effects(E1))
	require.Equal(t, 0, e.count(`SELECT count(*) FROM effect WHERE note <> 'ok'`), "failed attempts left nothing")
}

// counterVec reads one series of a registered counter.
func counterVec(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			c.Add(m.GetCounter().GetValue())
		}
	}
	return c
}

func TestIsTransientClassification(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"08000", "08006", "57P01", "40001", "40P01", "55P03", "53300"} {
		require.True(t, inbox.IsTransient(&pgconn.PgError{Code: code}), code)
		require.True(t, inbox.ShouldPoison(errors.New("x")))
		require.False(t, inbox.ShouldPoison(&pgconn.PgError{Code: code}), code)
	}
	for _, code := range []string{"23505", "42P01", "22P02", "25P02"} {
		require.False(t, inbox.IsTransient(&pgconn.PgError{Code: code}), code)
	}
	// mysqlerr.IsTransient: TestIsTransientDeadlockAndLockWait (module middleware/mysqlerr).
	require.True(t, inbox.IsTransient(inbox.ErrInFlight))
	require.False(t, inbox.IsTransient(errors.New("connection refused"))) // never by message text
	require.False(t, inbox.IsPermanent(errors.New("x")))
	require.False(t, inbox.IsTransient(inbox.Permanent(context.DeadlineExceeded)), "permanent wins")
	require.Nil(t, inbox.Permanent(nil))
}

func TestChainAfterPoisonSitsBetweenPoisonAndRetry(t *testing.T) {
	t.Parallel()
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "c"}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 2)}
	var seen []error
	router := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			seen = append(seen, err)
			if err != nil && errors.Is(err, inbox.ErrInvalidEventID) {
				return nil, nil // routed elsewhere: the poison topic never sees it
			}
			return out, err
		}
	}
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "p",
		AfterPoison: []message.HandlerMiddleware{router}, MaxRetries: 2, InitialInterval: time.Millisecond,
	}, nil)
	require.NoError(t, err)
	require.Len(t, chain, 5)
	var h message.HandlerFunc = func(*message.Message) ([]*message.Message, error) { return nil, nil }
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	_, err = h(newMsg("not-a-uuid"))
	require.NoError(t, err)
	require.Len(t, seen, 1, "outside Retry: sees the final error once")
	require.Empty(t, poison.msgs)
}

func TestChainConfigValidate(t *testing.T) {
	t.Parallel()
	_, err := inbox.NewChain(inbox.ChainConfig{}, nil)
	require.ErrorContains(t, err, "ChainConfig.Idempotent")
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "c"}, nil)
	require.NoError(t, err)
	_, err = inbox.NewChain(inbox.ChainConfig{Idempotent: idem}, nil)
	require.ErrorContains(t, err, "ChainConfig.PoisonPublisher")
	_, err = inbox.NewChain(inbox.ChainConfig{Idempotent: idem, PoisonPublisher: &capture{}}, nil)
	require.ErrorContains(t, err, "ChainConfig.PoisonTopic")
}

func TestAttemptsAreCountedInMetadata(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
	}, nil)
	require.NoError(t, err)
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "p",
		MaxRetries: 2, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
	}, nil)
	require.NoError(t, err)
	var h message.HandlerFunc = func(*message.Message) ([]*message.Message, error) { return nil, errors.New("always") }
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	_, err = h(newMsg(E1))
	require.NoError(t, err)
	require.Equal(t, "3", (<-poison.msgs).Metadata.Get(inbox.MetadataAttempt))
}
