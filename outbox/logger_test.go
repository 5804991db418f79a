package outbox_test

import (
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// testLogger captures log entries like watermill.CaptureLoggerAdapter, but
// its Captured returns a copy: the relay logs from its own goroutine while
// a test reads (watermill's Captured hands out its live map).
type testLogger struct {
	mu     *sync.Mutex
	logged *map[watermill.LogLevel][]watermill.CapturedMessage
	fields watermill.LogFields
}

func newTestLogger() *testLogger {
	m := map[watermill.LogLevel][]watermill.CapturedMessage{}
	return &testLogger{mu: &sync.Mutex{}, logged: &m}
}

func (l *testLogger) capture(level watermill.LogLevel, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	(*l.logged)[level] = append((*l.logged)[level], watermill.CapturedMessage{
		Level: level, Time: time.Now(), Fields: l.fields.Add(fields), Msg: msg, Err: err,
	})
}

// Captured returns a copy of what was logged, by level.
func (l *testLogger) Captured() map[watermill.LogLevel][]watermill.CapturedMessage {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[watermill.LogLevel][]watermill.CapturedMessage, len(*l.logged))
	for k, v := range *l.logged {
		out[k] = append([]watermill.CapturedMessage(nil), v...)
	}
	return out
}

func (l *testLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.capture(watermill.ErrorLogLevel, msg, err, fields)
}
func (l *testLogger) Info(msg string, fields watermill.LogFields) {
	l.capture(watermill.InfoLogLevel, msg, nil, fields)
}
func (l *testLogger) Debug(msg string, fields watermill.LogFields) {
	l.capture(watermill.DebugLogLevel, msg, nil, fields)
}
func (l *testLogger) Trace(msg string, fields watermill.LogFields) {
	l.capture(watermill.TraceLogLevel, msg, nil, fields)
}

func (l *testLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	l.mu.Lock()
	defer l.mu.Unlock()
	return &testLogger{mu: l.mu, logged: l.logged, fields: l.fields.Copy().Add(fields)}
}
