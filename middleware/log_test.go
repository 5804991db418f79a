package middleware_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/middleware"
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
	l.add("error", msg, f.Add(watermill.LogFields{"err": err}))
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
	m, err := middleware.NewIdempotent(middleware.Config{
		Beginner: middleware.NewPgxBeginner(e.pool, middleware.PgxBeginnerConfig{}),
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
		require.NotEqual(t, "error", l.level, "the middleware logs no error itself: %v", l)
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
	require.Equal(t, map[string]string{"failed": "info", "processed": "trace", "duplicate": "debug"}, outcomes)
	require.False(t, strings.Contains(fmt.Sprint(logger.lines), secret))
}

// A rejected message is logged with its reason (not only in the DLQ headers).
func TestRejectionIsLoggedWithReason(t *testing.T) {
	t.Parallel()
	logger := &captureLogger{}
	m, err := middleware.NewIdempotent(middleware.Config{Beginner: middleware.NewStdBeginner(nil), Consumer: "stock"}, logger)
	require.NoError(t, err)
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	bad := newMsg(E1)
	bad.Metadata.Set("idempotency_malformed", "true")
	bad.Metadata.Set("idempotency_malformed_reason", "envelope: not a JSON object")
	_, err = h(bad)
	require.Error(t, err)
	logger.mu.Lock()
	defer logger.mu.Unlock()
	require.Len(t, logger.lines, 1)
	require.Equal(t, "rejected", logger.lines[0].fields["outcome"])
	require.Contains(t, fmt.Sprint(logger.lines[0].fields["err"]), "not a JSON object")
}
