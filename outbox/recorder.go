package outbox

import "time"

// Recorder receives a relay's metrics. Implementations must be safe for
// concurrent use and fast (they run in the relay loop). outbox/outboxprom
// implements it with Prometheus.
type Recorder interface {
	// Round is called after each committed relay round with the rows it
	// published (0 for an empty round).
	Round(published int)
	// PublishFailed is called for each failed publish of a row to topic.
	PublishFailed(topic string)
	// DeadLettered is called for each row moved to the dead-letter table.
	DeadLettered(topic string)
	// Pending is called every RelayConfig.StatsInterval with the pending
	// rows and the age of the oldest (0 when none).
	Pending(rows int, oldest time.Duration)
}

// nopRecorder records nothing.
type nopRecorder struct{}

// Round implements Recorder.
func (nopRecorder) Round(int) {}

// PublishFailed implements Recorder.
func (nopRecorder) PublishFailed(string) {}

// DeadLettered implements Recorder.
func (nopRecorder) DeadLettered(string) {}

// Pending implements Recorder.
func (nopRecorder) Pending(int, time.Duration) {}

// BackPressureRecorder is implemented by a Recorder that also counts
// back-pressure (RelayConfig.BackPressure): the relay calls BackPressured
// for each publish of a row to topic that the broker pushed back (a full
// queue's nack, a timed-out or blocked publish), besides PublishFailed.
type BackPressureRecorder interface {
	BackPressured(topic string)
}

// BackPressured implements BackPressureRecorder.
func (nopRecorder) BackPressured(string) {}
