package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
)

type logLine struct {
	level  string
	msg    string
	fields watermill.LogFields
}

type captureLogger struct {
	mu    sync.Mutex
	lines []logLine
}

func (l *captureLogger) add(level, msg string, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, logLine{level, msg, f})
}
func (l *captureLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add("error", msg, f.Add(watermill.LogFields{"error": err}))
}
func (l *captureLogger) Info(msg string, f watermill.LogFields)  { l.add("info", msg, f) }
func (l *captureLogger) Debug(msg string, f watermill.LogFields) { l.add("debug", msg, f) }
func (l *captureLogger) Trace(msg string, f watermill.LogFields) { l.add("trace", msg, f) }
func (l *captureLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return l
}

// Outcomes are logged with event_id, event_name, consumer, outcome, attempt
// and duration; a duplicate is logged at debug, never as an error; the
// payload is never logged.
func TestLogFieldsAndLevels(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logger := &captureLogger{}
	m, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
	}, logger)
	require.NoError(t, err)
	fail := true
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if fail {
			fail = false
			return nil, errors.New("first fails")
		}
		return nil, nil
	})
	secret := `{"card":"4111111111111111"}`
	for i := 0; i < 3; i++ {
		msg := newMsg(E1)
		msg.Payload = []byte(secret)
		_, _ = h(msg)
	}
	logger.mu.Lock()
	defer logger.mu.Unlock()
	outcomes := map[string]string{}
	for _, l := range logger.lines {
		require.NotContains(t, fmt.Sprint(l.fields), "4111", "payload leaked into logs")
		o, _ := l.fields["outcome"].(string)
		if o == "" {
			continue
		}
		outcomes[o] = l.level
		for _, k := range []string{"event_id", "event_name", "consumer", "attempt", "duration"} {
			require.Contains(t, l.fields, k, "log line %q lacks %s", l.msg, k)
		}
	}
	require.Equal(t, map[string]string{"failed": "error", "processed": "trace", "duplicate": "debug"}, outcomes,
		"a handler error (bound for the poison topic after the retries) is logged with Error")
	require.False(t, strings.Contains(fmt.Sprint(logger.lines), secret))
}

// TestRejectionLoggedAsErrorWithReason (C13): a rejected message is logged
// with Error (never at info), its reason and error, and under
// transport_message_id, not event_id: msg.UUID of a malformed delivery is the
// transport's message id, not an event id.
func TestRejectionLoggedAsErrorWithReason(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "stock"}, logger)
	require.NoError(t, err)
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	bad := newMsg("amqp-message-id-17")
	bad.Metadata.Set("idempotency_malformed", "true")
	bad.Metadata.Set("idempotency_malformed_reason", "envelope: not a JSON object")
	_, err = h(bad)
	require.Error(t, err)
	logger.mu.Lock()
	defer logger.mu.Unlock()
	require.Len(t, logger.lines, 1)
	l := logger.lines[0]
	require.Equal(t, "error", l.level)
	require.Equal(t, "rejected", l.fields["outcome"])
	require.Equal(t, "malformed", l.fields["reason"])
	require.Contains(t, fmt.Sprint(l.fields["error"]), "not a JSON object")
	require.NotContains(t, l.fields, "err")
	require.NotContains(t, l.fields, "event_id", "a malformed message has no event id")
	require.Equal(t, "amqp-message-id-17", l.fields["transport_message_id"])
}

// TestEmptyUUIDIsAConfigurationErrorNamingTheMarshaler (C13): a message with
// no msg.UUID (Watermill's default marshalers leave it empty) fails with a
// configuration error (held, never dead-lettered) that says to configure the
// envelope marshaler, not `invalid event_id: ""`.
func TestEmptyUUIDIsAConfigurationErrorNamingTheMarshaler(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "stock"}, logger)
	require.NoError(t, err)
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err = h(newMsg(""))
	require.ErrorIs(t, err, inbox.ErrInvalidEventID)
	require.True(t, inbox.IsConfiguration(err), "held until the subscriber's marshaler is fixed, not dead-lettered: %v", err)
	require.False(t, inbox.IsPermanent(err))
	require.ErrorContains(t, err, "amqp.Marshaler")
	require.NotContains(t, err.Error(), `""`)
	logger.mu.Lock()
	defer logger.mu.Unlock()
	require.Len(t, logger.lines, 1)
	require.Equal(t, "error", logger.lines[0].level)
}

// A message whose id is present but not a UUID (a producer's own message id)
// is permanent: it is dead-lettered once, reason invalid_event_id.
func TestMessageIDThatIsNotAUUIDIsPermanent(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: inbox.NewSQLSubscriberBeginner(), Consumer: "stock"}, logger)
	require.NoError(t, err)
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, err = h(newMsg("order-42"))
	require.ErrorIs(t, err, inbox.ErrInvalidEventID)
	require.True(t, inbox.IsPermanent(err))
	logger.mu.Lock()
	defer logger.mu.Unlock()
	require.Len(t, logger.lines, 1)
	require.Equal(t, "invalid_event_id", logger.lines[0].fields["reason"])
}

// TestErrorsOnOneLineSameTextAsReturned (C13): a multi-line error (errors.Join
// from a handler; pgconn's connect error, one line per address) is returned
// and logged on one line, the same text, and still unwraps to its causes.
func TestErrorsOnOneLineSameTextAsReturned(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	logger := &captureLogger{}
	m, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
	}, logger)
	require.NoError(t, err)
	cause := errors.New("second cause")
	_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.Join(errors.New("first cause"), cause)
	})(newMsg(E1))
	require.ErrorIs(t, err, cause)
	require.Equal(t, "first cause; second cause", err.Error())

	// A pool on a closed port: pgconn reports each address on its own line.
	cfg, perr := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1,127.0.0.1:2/test?connect_timeout=2")
	require.NoError(t, perr)
	dead, perr := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, perr)
	defer dead.Close()
	m2, err2 := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(dead, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "stock",
	}, logger)
	require.NoError(t, err2)
	_, err2 = m2.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(newMsg(E2))
	require.Error(t, err2)
	require.True(t, inbox.IsTransient(err2))
	require.NotContains(t, err2.Error(), "\n")
	require.Contains(t, err2.Error(), "127.0.0.1:2")

	logger.mu.Lock()
	defer logger.mu.Unlock()
	var logged, levels []string
	for _, l := range logger.lines {
		if l.fields["outcome"] == "failed" {
			require.NotContains(t, l.fields, "err")
			logged = append(logged, fmt.Sprint(l.fields["error"]))
			levels = append(levels, l.level)
		}
	}
	require.Equal(t, []string{err.Error(), err2.Error()}, logged)
	require.Equal(t, []string{"error", "info"}, levels, "a handler error is logged as an error; a transient one (retried, never poisoned) at info")
}
