// Package metrics exports the middleware's outcomes and the purgers' work as
// Prometheus collectors, registered on a Registerer the caller passes (never
// the global one implicitly).
//
//	idempotency_attempts_total{consumer,handler_name,outcome}                 counter
//	idempotency_claim_duration_seconds{consumer,handler_name}                 histogram (acquire + BEGIN + claim)
//	idempotency_attempt_duration_seconds{consumer,handler_name,outcome}       histogram (whole attempt)
//	idempotency_purged_rows_total{table}                                      counter
//	idempotency_last_purge_timestamp_seconds{table}                           gauge (Unix seconds)
//
// Every attempt is counted, a redelivery and a retry too: attempts_total
// counts attempts, not distinct messages. outcome is one of
// middleware.Outcome: processed, duplicate, stale, obsolete, failed,
// rejected, expired, future, conflict, and stalled (a report that no
// attempt finished for a minute, counted in attempts_total only, with
// handler_name "<no handler>", not in attempt_duration_seconds).
// handler_name is the Watermill router handler's name, the label
// Watermill's own metrics (components/metrics,
// handler_execution_time_seconds) use for it, "<no handler>" outside a
// router; consumer is the claim's consumer name, which Watermill has no
// label for. table is the purged table, one series per purger.
//
// The duration histograms default to 20 exponential bounds from
// 10 µs, so a claim of about 60 µs falls between the 40 µs and 80 µs
// bounds instead of in the first bucket of prometheus.DefBuckets (5 ms).
package metrics

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-idempotency/idempotency/middleware"
)

// DefaultNamespace prefixes every metric name.
const DefaultNamespace = "idempotency"

// Default duration buckets: bucketCount bounds from bucketStart, each
// bucketFactor times the previous one
// (10 µs … about 5.2 s).
const (
	bucketStart  = 10 * time.Microsecond
	bucketFactor = 2.0
	bucketCount  = 20
)

// NoHandlerName is the handler_name label of an attempt outside a Watermill
// router, as Watermill's own metrics label it.
const NoHandlerName = "<no handler>"

// defaultBuckets returns the default bounds of the duration histograms, in
// seconds: 20 bounds from 10 µs, each twice the previous one (10 µs to
// about 5.2 s). A new slice on every call.
func defaultBuckets() []float64 {
	return prometheus.ExponentialBuckets(bucketStart.Seconds(), bucketFactor, bucketCount)
}

// Config configures NewPrometheus.
type Config struct {
	// Registerer receives the collectors. Required (pass
	// prometheus.DefaultRegisterer explicitly to use the global one).
	Registerer prometheus.Registerer
	// Namespace prefixes metric names. Defaults to DefaultNamespace.
	Namespace string
	// Buckets of the duration histograms, in seconds, increasing.
	// Defaults to 20 bounds from 10 µs, each twice the previous (to about 5.2 s).
	Buckets []float64
}

// Validate reports the first invalid field, naming it.
func (c Config) Validate() error {
	if c.Registerer == nil {
		return errors.New("metrics: Config.Registerer is required")
	}
	for i := 1; i < len(c.Buckets); i++ {
		if c.Buckets[i] <= c.Buckets[i-1] {
			return errors.New("metrics: Config.Buckets must be increasing")
		}
	}
	return nil
}

// Prometheus implements middleware.Recorder and records purges (OnPurge
// returns a processed.PurgerConfig.OnPurge / versioned purger OnPurge per
// table).
type Prometheus struct {
	attempts    *prometheus.CounterVec
	claim       *prometheus.HistogramVec
	attemptTime *prometheus.HistogramVec
	purged      *prometheus.CounterVec
	lastPurge   *prometheus.GaugeVec
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
		cfg.Buckets = defaultBuckets()
	}
	p := &Prometheus{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: cfg.Namespace, Name: "attempts_total",
			Help: "Attempts (every delivery and retry) by consumer, handler and outcome (processed, duplicate, stale, obsolete, failed, rejected, expired).",
		}, []string{"consumer", "handler_name", "outcome"}),
		claim: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: cfg.Namespace, Name: "claim_duration_seconds", Buckets: cfg.Buckets,
			Help: "Time to acquire a connection, begin and claim the event, in seconds.",
		}, []string{"consumer", "handler_name"}),
		attemptTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: cfg.Namespace, Name: "attempt_duration_seconds", Buckets: cfg.Buckets,
			Help: "Whole attempt (claim, handler, commit or rollback), in seconds.",
		}, []string{"consumer", "handler_name", "outcome"}),
		purged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: cfg.Namespace, Name: "purged_rows_total",
			Help: "Rows deleted by the purger of table.",
		}, []string{"table"}),
		lastPurge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: cfg.Namespace, Name: "last_purge_timestamp_seconds",
			Help: "Unix time of the last purge run of table that held the lock.",
		}, []string{"table"}),
	}
	for _, c := range []prometheus.Collector{p.attempts, p.claim, p.attemptTime, p.purged, p.lastPurge} {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// RecordOutcome implements middleware.Recorder.
func (p *Prometheus) RecordOutcome(o middleware.Observation) {
	handler := o.HandlerName
	if handler == "" {
		handler = NoHandlerName
	}
	outcome := string(o.Outcome)
	p.attempts.WithLabelValues(o.Consumer, handler, outcome).Inc()
	if o.Claim > 0 {
		p.claim.WithLabelValues(o.Consumer, handler).Observe(o.Claim.Seconds())
	}
	if o.Outcome == middleware.OutcomeStalled {
		// A report that no attempt finished, with the idle time as Total:
		// counted, but no attempt's duration.
		return
	}
	p.attemptTime.WithLabelValues(o.Consumer, handler, outcome).Observe(o.Total.Seconds())
}

// OnPurge returns the callback recording the purge runs of table (its
// table label): pass it as processed.PurgerConfig.OnPurge or the versioned
// purger's OnPurge. Two purgers given two tables are two series.
func (p *Prometheus) OnPurge(table string) func(deleted int64, at time.Time) {
	purged, last := p.purged.WithLabelValues(table), p.lastPurge.WithLabelValues(table)
	return func(deleted int64, at time.Time) {
		purged.Add(float64(deleted))
		last.Set(float64(at.UnixNano()) / 1e9)
	}
}
