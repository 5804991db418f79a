// Package outboxprom exports an outbox relay's metrics (outbox.Recorder) as
// Prometheus collectors, registered on a Registerer the caller passes:
//
//	idempotency_outbox_pending_rows{outbox}                   gauge (every RelayConfig.StatsInterval)
//	idempotency_outbox_oldest_pending_age_seconds{outbox}     gauge (0 when nothing is pending)
//	idempotency_outbox_relayed_total{outbox}                  counter
//	idempotency_outbox_relay_rounds_total{outbox}             counter
//	idempotency_outbox_publish_failures_total{outbox,topic}   counter
//	idempotency_outbox_dead_lettered_total{outbox,topic}      counter
//
// Alert on the oldest pending age (the relay is down or stuck) and on
// dead-lettered rows (rows that will never be published without an operator).
package outboxprom

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-idempotency/idempotency/metrics"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// Config configures New.
type Config struct {
	// Registerer receives the collectors. Required (pass
	// prometheus.DefaultRegisterer explicitly to use the global one).
	Registerer prometheus.Registerer
	// Namespace prefixes metric names. Defaults to metrics.DefaultNamespace.
	Namespace string
	// Outbox is the "outbox" label of every series (the outbox table, say).
	// Required.
	Outbox string
}

// Validate reports the first invalid field, naming it.
func (c Config) Validate() error {
	switch {
	case c.Registerer == nil:
		return errors.New("outboxprom: Config.Registerer is required")
	case c.Outbox == "":
		return errors.New("outboxprom: Config.Outbox is required")
	}
	return nil
}

// Recorder implements outbox.Recorder with Prometheus collectors.
type Recorder struct {
	pending, oldest  prometheus.Gauge
	relayed, rounds  prometheus.Counter
	failures, deadLt *prometheus.CounterVec
	backPressure     *prometheus.CounterVec
}

var (
	_ outbox.Recorder             = (*Recorder)(nil)
	_ outbox.BackPressureRecorder = (*Recorder)(nil)
)

// New creates and registers the collectors. Registering the same Outbox
// twice on one Registerer fails with prometheus.AlreadyRegisteredError;
// relays of different outboxes share the collectors' families (register
// each through its own Registerer wrapped with prometheus.WrapRegistererWith
// if that is a problem).
func New(cfg Config) (*Recorder, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Namespace == "" {
		cfg.Namespace = metrics.DefaultNamespace
	}
	labels := prometheus.Labels{"outbox": cfg.Outbox}
	r := &Recorder{
		pending: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "pending_rows", ConstLabels: labels,
			Help: "Outbox rows committed and not yet relayed."}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "oldest_pending_age_seconds", ConstLabels: labels,
			Help: "Age of the oldest pending outbox row (0 when none)."}),
		relayed: prometheus.NewCounter(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "relayed_total", ConstLabels: labels,
			Help: "Outbox rows published and removed."}),
		rounds: prometheus.NewCounter(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "relay_rounds_total", ConstLabels: labels,
			Help: "Committed relay rounds (claim transactions)."}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "publish_failures_total", ConstLabels: labels,
			Help: "Failed publishes of outbox rows, by destination topic."}, []string{"topic"}),
		deadLt: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "dead_lettered_total", ConstLabels: labels,
			Help: "Outbox rows moved to the dead-letter table, by destination topic."}, []string{"topic"}),
		backPressure: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: cfg.Namespace, Subsystem: "outbox", Name: "back_pressure_total", ConstLabels: labels,
			Help: "Publishes of outbox rows the broker pushed back (full queue, blocked or timed-out publish), by destination topic; never counted against the row."}, []string{"topic"}),
	}
	for _, c := range []prometheus.Collector{r.pending, r.oldest, r.relayed, r.rounds, r.failures, r.deadLt, r.backPressure} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// Round implements outbox.Recorder.
func (r *Recorder) Round(published int) {
	r.rounds.Inc()
	r.relayed.Add(float64(published))
}

// BackPressured implements outbox.BackPressureRecorder.
func (r *Recorder) BackPressured(topic string) { r.backPressure.WithLabelValues(topic).Inc() }

// PublishFailed implements outbox.Recorder.
func (r *Recorder) PublishFailed(topic string) { r.failures.WithLabelValues(topic).Inc() }

// DeadLettered implements outbox.Recorder.
func (r *Recorder) DeadLettered(topic string) { r.deadLt.WithLabelValues(topic).Inc() }

// Pending implements outbox.Recorder.
func (r *Recorder) Pending(rows int, oldest time.Duration) {
	r.pending.Set(float64(rows))
	r.oldest.Set(oldest.Seconds())
}
