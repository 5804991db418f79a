// Package metrics exports the middleware's outcomes and the purger's work as
// Prometheus collectors, registered on a Registerer the caller passes (never
// the global one implicitly).
//
//	idempotency_messages_total{consumer,outcome}          counter
//	idempotency_claim_duration_seconds{consumer}          histogram (acquire + BEGIN + claim)
//	idempotency_transaction_duration_seconds{consumer}    histogram (whole attempt)
//	idempotency_purged_rows_total                         counter
//	idempotency_last_purge_timestamp_seconds              gauge (Unix seconds)
//
// outcome is one of middleware.Outcome: processed, duplicate, stale, obsolete, failed,
// rejected, expired.
package metrics

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// DefaultNamespace prefixes every metric name.
const DefaultNamespace = "idempotency"

// Config configures NewPrometheus.
type Config struct {
	// Registerer receives the collectors. Required (pass
	// prometheus.DefaultRegisterer explicitly to use the global one).
	Registerer prometheus.Registerer
	// Namespace prefixes metric names. Defaults to DefaultNamespace.
	Namespace string
	// Buckets of the duration histograms, in seconds. Defaults to
	// prometheus.DefBuckets.
	Buckets []float64
}

// Validate reports the first invalid field, naming it.
func (c Config) Validate() error {
	if c.Registerer == nil {
		return errors.New("metrics: Config.Registerer is required")
	}
	return nil
}

// Prometheus implements middleware.Recorder and records purges (RecordPurge,
// which has the shape of processed.PurgerConfig.OnPurge).
type Prometheus struct {
	messages    *prometheus.CounterVec
	claim       *prometheus.HistogramVec
	transaction *prometheus.HistogramVec
	purged      prometheus.Counter
	lastPurge   prometheus.Gauge
}

var _ middleware.Recorder = (*Prometheus)(nil)

// NewPrometheus creates and registers the collectors. Registering twice on
// one Registerer fails with prometheus.AlreadyRegisteredError.
func NewPrometheus(cfg Config) (*Prometheus, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Namespace == "" {
		cfg.Namespace = DefaultNamespace
	}
	if cfg.Buckets == nil {
		cfg.Buckets = prometheus.DefBuckets
	}
	p := &Prometheus{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: cfg.Namespace, Name: "messages_total",
			Help: "Message attempts by consumer and outcome (processed, duplicate, stale, failed, rejected, expired).",
		}, []string{"consumer", "outcome"}),
		claim: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: cfg.Namespace, Name: "claim_duration_seconds", Buckets: cfg.Buckets,
			Help: "Time to acquire a connection, begin and claim (consumer, event_id).",
		}, []string{"consumer"}),
		transaction: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: cfg.Namespace, Name: "transaction_duration_seconds", Buckets: cfg.Buckets,
			Help: "Whole attempt: claim, handler and commit or rollback.",
		}, []string{"consumer"}),
		purged: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: cfg.Namespace, Name: "purged_rows_total",
			Help: "Processed-event rows deleted by the purger.",
		}),
		lastPurge: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: cfg.Namespace, Name: "last_purge_timestamp_seconds",
			Help: "Unix time of the last purge run that held the lock.",
		}),
	}
	for _, c := range []prometheus.Collector{p.messages, p.claim, p.transaction, p.purged, p.lastPurge} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// RecordOutcome implements middleware.Recorder.
func (p *Prometheus) RecordOutcome(o middleware.Observation) {
	p.messages.WithLabelValues(o.Consumer, string(o.Outcome)).Inc()
	if o.Claim > 0 {
		p.claim.WithLabelValues(o.Consumer).Observe(o.Claim.Seconds())
	}
	p.transaction.WithLabelValues(o.Consumer).Observe(o.Total.Seconds())
}

// RecordPurge records one purge run; pass it as processed.PurgerConfig.OnPurge.
func (p *Prometheus) RecordPurge(deleted int64, at time.Time) {
	p.purged.Add(float64(deleted))
	p.lastPurge.Set(float64(at.UnixNano()) / 1e9)
}
