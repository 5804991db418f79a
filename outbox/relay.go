package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// Relay defaults (RelayConfig).
const (
	// DefaultBatchSize is the rows one relay round claims. A crash after
	// publishing part of a round republishes up to that many rows.
	DefaultBatchSize = 100
	// DefaultPollInterval is the wait after a round that found less than a
	// full batch: the relay's delivery latency when idle.
	DefaultPollInterval = 50 * time.Millisecond
	// DefaultRetryInterval is the first retry delay of a failed row, and the
	// first wait after a round that failed as a whole (database error, no
	// publish succeeded); each further failure doubles it.
	DefaultRetryInterval = 100 * time.Millisecond
	// DefaultMaxBackoff caps the retry delays.
	DefaultMaxBackoff = 30 * time.Second
	// DefaultMaxAttempts is the publish attempts of a row before it is
	// dead-lettered.
	DefaultMaxAttempts = 10
	// DefaultStatsInterval is how often the relay counts pending rows
	// (Recorder.Pending), checks the oldest against StalledAfter and purges
	// the archive.
	DefaultStatsInterval = 10 * time.Second
	// DefaultStalledAfter is the age of the oldest pending row above which
	// the relay logs a warning.
	DefaultStalledAfter = time.Minute
	// maxReason bounds the dead-letter reason stored and logged.
	maxReason = 4000
)

// RelayConfig configures NewRelay. Zero values take the defaults above.
type RelayConfig struct {
	// BatchSize is the rows one round (one transaction) claims. Defaults to
	// DefaultBatchSize.
	BatchSize int
	// PollInterval is the wait after a round that claimed less than a full
	// batch. Defaults to DefaultPollInterval.
	PollInterval time.Duration
	// RetryInterval is the backoff base (see DefaultRetryInterval).
	RetryInterval time.Duration
	// MaxBackoff caps the backoff. Defaults to DefaultMaxBackoff.
	MaxBackoff time.Duration
	// MaxAttempts is the publish attempts of a row before it is moved to the
	// dead-letter table. A row is dead-lettered only once some publish
	// succeeded after its first failure (or Permanent says so): while every
	// publish fails the broker is taken to be down, and rows wait for it at
	// MaxBackoff instead of being dead-lettered. Defaults to
	// DefaultMaxAttempts.
	MaxAttempts int
	// Permanent, if set, classifies a publish error as permanent (the row can
	// never be published, e.g. the marshaler refuses it): the row is
	// dead-lettered at once. Classify by type or origin, not message text.
	Permanent func(error) bool
	// Parallel lets several relays of the outbox publish at once, each
	// claiming a disjoint batch (SKIP LOCKED). It gives up order across
	// batches: rows may reach the broker in any order. Default false: one
	// relay publishes at a time (the lock row), the others stand by. Not
	// supported on SQLite (one writer).
	Parallel bool
	// Retention keeps relayed rows in the archive table (<table>_relayed) for
	// this long, for Replay; the relay purges older ones every
	// StatsInterval. 0 deletes relayed rows at once (nothing to replay).
	Retention time.Duration
	// StatsInterval is how often the relay reports pending rows, warns about
	// a stalled outbox and purges the archive. Defaults to
	// DefaultStatsInterval.
	StatsInterval time.Duration
	// StalledAfter: when the oldest pending row is older, the relay logs a
	// warning (Warn if the logger has one, else Error with ErrStalled).
	// Defaults to DefaultStalledAfter.
	StalledAfter time.Duration
	// Recorder receives the relay's metrics. Defaults to NopRecorder.
	Recorder Recorder
}

func (c *RelayConfig) setDefaults() {
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = DefaultRetryInterval
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = DefaultStatsInterval
	}
	if c.StalledAfter == 0 {
		c.StalledAfter = DefaultStalledAfter
	}
	if c.Recorder == nil {
		c.Recorder = NopRecorder{}
	}
}

// Validate reports the first invalid field, naming it.
func (c RelayConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    time.Duration
	}{{"PollInterval", c.PollInterval}, {"RetryInterval", c.RetryInterval}, {"MaxBackoff", c.MaxBackoff},
		{"Retention", c.Retention}, {"StatsInterval", c.StatsInterval}, {"StalledAfter", c.StalledAfter}} {
		if f.v < 0 {
			return fmt.Errorf("outbox: RelayConfig.%s %s: must be ≥ 0", f.name, f.v)
		}
	}
	switch {
	case c.BatchSize < 0 || c.BatchSize > 1000:
		return fmt.Errorf("outbox: RelayConfig.BatchSize %d: must be in [0, 1000]", c.BatchSize)
	case c.MaxAttempts < 0:
		return fmt.Errorf("outbox: RelayConfig.MaxAttempts %d: must be ≥ 0", c.MaxAttempts)
	}
	return nil
}

// ErrStalled is logged (at ERROR, for loggers without Warn) when the oldest
// pending row is older than RelayConfig.StalledAfter.
var ErrStalled = errors.New("outbox: oldest pending row older than the stall threshold")

// Relay publishes an outbox's committed rows and removes them. See the
// package documentation for its guarantees. Run it once; Close stops it.
type Relay struct {
	o       *Outbox
	db      wsql.Beginner
	dest    message.Publisher
	cfg     RelayConfig
	logger  watermill.LoggerAdapter
	txOpts  *sql.TxOptions
	started atomic.Bool
	running chan struct{}
	runOnce sync.Once
	closing chan struct{}
	closeMu sync.Once
	done    chan struct{}
	// lastOK is the unix µs of the relay's last successful publish.
	lastOK atomic.Int64
}

// NewRelay validates cfg (on a copy with defaults applied) and returns a
// relay of the outbox in db to dest (for example a watermill-amqp publisher
// with confirms: a nil error from Publish must mean "the broker has it").
// The relay does not close dest. It does not start (Run).
func (o *Outbox) NewRelay(db wsql.Beginner, dest message.Publisher, cfg RelayConfig) (*Relay, error) {
	switch {
	case db == nil:
		return nil, errors.New("outbox: NewRelay: nil database")
	case dest == nil:
		return nil, errors.New("outbox: NewRelay: destination publisher is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Parallel && o.cfg.Dialect == sqldb.SQLite {
		return nil, errors.New("outbox: RelayConfig.Parallel: not supported on SQLite (one writer)")
	}
	cfg.setDefaults()
	r := &Relay{
		o: o, db: db, dest: dest, cfg: cfg,
		logger:  o.logger.With(watermill.LogFields{"outbox": o.cfg.Table}),
		running: make(chan struct{}),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}
	if o.cfg.Dialect != sqldb.SQLite {
		r.txOpts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	return r, nil
}

// Run relays until ctx is done or Close is called; it returns nil then. It
// returns an error only when called twice.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called twice")
	}
	defer close(r.done)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-r.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	var nextStats time.Time
	failures := 0
	for {
		if now := time.Now(); !now.Before(nextStats) {
			r.housekeeping(ctx)
			nextStats = now.Add(r.cfg.StatsInterval)
		}
		res, err := r.round(ctx)
		r.runOnce.Do(func() { close(r.running) })
		if ctx.Err() != nil {
			return nil
		}
		var wait time.Duration
		switch {
		case err != nil:
			r.logger.Error("outbox relay round failed", err, nil)
			wait = r.backoff(failures)
			failures++
		case res.failed > 0 && res.published == 0:
			wait = r.backoff(failures) // the broker looks down
			failures++
		case res.claimed == r.cfg.BatchSize:
			failures = 0
		default:
			wait = r.cfg.PollInterval
			failures = 0
		}
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
		}
	}
}

// Running is closed once the relay has run its first round (as the active
// relay or standing by).
func (r *Relay) Running() chan struct{} { return r.running }

// Close stops the relay and waits for Run to return. A round in flight rolls
// back: its rows stay pending and are published again (same event_id) by the
// next relay. It does not close the destination publisher.
func (r *Relay) Close() error {
	r.closeMu.Do(func() { close(r.closing) })
	if r.started.Load() {
		<-r.done
	}
	return nil
}

// backoff is RetryInterval·2^n, capped at MaxBackoff.
func (r *Relay) backoff(n int) time.Duration {
	d := r.cfg.RetryInterval
	for i := 0; i < n && d < r.cfg.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, r.cfg.MaxBackoff)
}

type pendingRow struct {
	id          int64
	eventID     string
	topic       string
	payload     []byte
	metadata    string
	attempts    int
	firstFailUs int64
	err         error
}

type roundResult struct{ claimed, published, failed int }

// round is one relay transaction: lock, claim, publish, remove, commit.
func (r *Relay) round(ctx context.Context) (res roundResult, err error) {
	tx, err := r.db.BeginTx(ctx, r.txOpts)
	if err != nil {
		return res, fmt.Errorf("begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	nowUs := time.Now().UnixMicro()
	if !r.cfg.Parallel {
		held, err := r.lock(ctx, tx, nowUs)
		if err != nil || !held {
			return res, err
		}
	}
	rows, err := r.claim(ctx, tx, nowUs)
	if err != nil {
		return res, err
	}
	res.claimed = len(rows)
	if len(rows) == 0 {
		committed = true
		if err := tx.Commit(); err != nil {
			return res, fmt.Errorf("commit: %w", err)
		}
		r.cfg.Recorder.Round(0)
		return res, nil
	}
	var ok []int64
	var failedTopics []string
	for i := range rows {
		row := &rows[i]
		if row.err = r.publish(ctx, row); row.err != nil {
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			res.failed++
			failedTopics = append(failedTopics, row.topic)
			continue
		}
		r.lastOK.Store(time.Now().UnixMicro())
		ok = append(ok, row.id)
	}
	res.published = len(ok)
	for _, t := range failedTopics {
		r.cfg.Recorder.PublishFailed(t)
	}
	if len(ok) > 0 {
		// The broker has these rows; a crash here republishes them.
		crashpoint.Reached(crashpoint.OutboxAfterPublish)
		if err := r.remove(ctx, tx, ok); err != nil {
			return res, err
		}
	}
	var dead []*pendingRow
	for i := range rows {
		row := &rows[i]
		if row.err == nil {
			continue
		}
		isDead, err := r.fail(ctx, tx, row)
		if err != nil {
			return res, err
		}
		if isDead {
			dead = append(dead, row)
		}
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return res, fmt.Errorf("commit: %w", err)
	}
	r.cfg.Recorder.Round(len(ok))
	for _, row := range dead {
		r.cfg.Recorder.DeadLettered(row.topic)
		r.logger.Error("outbox row dead-lettered", row.err, watermill.LogFields{
			"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": row.attempts + 1,
		})
	}
	return res, nil
}

// lock takes the outbox's relay lock for this transaction; false means
// another relay holds it (this one stands by).
func (r *Relay) lock(ctx context.Context, tx wsql.Tx, nowUs int64) (bool, error) {
	if r.o.cfg.Dialect == sqldb.SQLite {
		res, err := tx.ExecContext(ctx, r.o.q.lock, nowUs)
		if err != nil {
			return false, fmt.Errorf("relay lock: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return false, fmt.Errorf("relay lock: %w", err)
		}
		if n != 1 {
			return false, errors.New("relay lock: the lock row is missing (run Migrate)")
		}
		return true, nil
	}
	var name string
	switch err := queryRow(ctx, tx, r.o.q.lock, nil, &name); {
	case errors.Is(err, sql.ErrNoRows):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("relay lock: %w", err)
	}
	return true, nil
}

func (r *Relay) claim(ctx context.Context, tx wsql.Tx, nowUs int64) ([]pendingRow, error) {
	rows, err := tx.QueryContext(ctx, fmt.Sprintf(r.o.q.claim, r.cfg.BatchSize), nowUs)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	var out []pendingRow
	for rows.Next() {
		var p pendingRow
		if err := rows.Scan(&p.id, &p.eventID, &p.topic, &p.payload, &p.metadata, &p.attempts, &p.firstFailUs); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("claim: scan: %w", err)
		}
		out = append(out, p)
	}
	if err := rows.Close(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return out, nil
}

// publish sends one row as the message it was written as.
func (r *Relay) publish(ctx context.Context, row *pendingRow) error {
	msg, err := rowMessage(row.eventID, row.payload, row.metadata)
	if err != nil {
		return err
	}
	msg.SetContext(ctx)
	return r.dest.Publish(row.topic, msg)
}

// ErrBadMetadata is the reason of a row whose stored metadata is not a JSON
// object of strings: it is dead-lettered at once.
var ErrBadMetadata = errors.New("outbox: stored metadata is not a JSON object of strings")

func rowMessage(eventID string, payload []byte, metadata string) (*message.Message, error) {
	msg := message.NewMessage(eventID, payload)
	if metadata != "" {
		if err := json.Unmarshal([]byte(metadata), &msg.Metadata); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadMetadata, err)
		}
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	return msg, nil
}

func (r *Relay) remove(ctx context.Context, tx wsql.Tx, ids []int64) error {
	args := make([]any, 0, len(ids)+1)
	if r.cfg.Retention > 0 {
		args = append(args, time.Now().UnixMicro())
		for _, id := range ids {
			args = append(args, id)
		}
		if _, err := tx.ExecContext(ctx, r.o.q.archive(len(ids)), args...); err != nil {
			return fmt.Errorf("archive: %w", err)
		}
		args = args[:0]
	}
	for _, id := range ids {
		args = append(args, id)
	}
	if _, err := tx.ExecContext(ctx, r.o.q.delete(len(ids)), args...); err != nil {
		return fmt.Errorf("delete relayed: %w", err)
	}
	return nil
}

// fail records a failed publish of row: another attempt later, or the
// dead-letter table. It reports whether the row was dead-lettered.
func (r *Relay) fail(ctx context.Context, tx wsql.Tx, row *pendingRow) (bool, error) {
	nowUs := time.Now().UnixMicro()
	firstFail := row.firstFailUs
	if firstFail == 0 {
		firstFail = nowUs
	}
	attempts := row.attempts + 1
	permanent := errors.Is(row.err, ErrBadMetadata) || (r.cfg.Permanent != nil && r.cfg.Permanent(row.err))
	// Dead only when the broker took some message after this row first
	// failed: otherwise every failure may be the broker's outage.
	brokerUp := r.lastOK.Load() > firstFail
	reason := row.err.Error()
	if len(reason) > maxReason {
		reason = reason[:maxReason] + "… (truncated)"
	}
	if permanent || (attempts >= r.cfg.MaxAttempts && brokerUp) {
		if _, err := tx.ExecContext(ctx, r.o.q.deadLetter(), reason, nowUs, row.id); err != nil {
			return false, fmt.Errorf("dead-letter row %d: %w", row.id, err)
		}
		if _, err := tx.ExecContext(ctx, r.o.q.delete(1), row.id); err != nil {
			return false, fmt.Errorf("dead-letter row %d: %w", row.id, err)
		}
		return true, nil
	}
	next := nowUs + r.backoff(attempts-1).Microseconds()
	if _, err := tx.ExecContext(ctx, r.o.q.retry(), attempts, next, firstFail, reason, row.id); err != nil {
		return false, fmt.Errorf("retry row %d: %w", row.id, err)
	}
	r.logger.Info("outbox row publish failed, will retry", watermill.LogFields{
		"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": attempts, "error": reason,
	})
	return false, nil
}

type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// housekeeping reports pending rows, warns about a stalled outbox and
// purges the archive. Errors are logged; the relay goes on.
func (r *Relay) housekeeping(ctx context.Context) {
	n, oldest, err := r.o.stats(ctx, r.db)
	if err != nil {
		if ctx.Err() == nil {
			r.logger.Error("outbox stats", err, nil)
		}
		return
	}
	var age time.Duration
	if !oldest.IsZero() {
		age = max(time.Since(oldest), 0)
	}
	r.cfg.Recorder.Pending(n, age)
	if age > r.cfg.StalledAfter {
		fields := watermill.LogFields{"pending": n, "oldest_age": age.String(), "threshold": r.cfg.StalledAfter.String()}
		if w, ok := r.o.logger.(warner); ok {
			w.Warn("outbox: oldest pending row older than the stall threshold", fields)
		} else {
			r.logger.Error("outbox stalled", ErrStalled, fields)
		}
	}
	if r.cfg.Retention > 0 {
		cut := time.Now().Add(-r.cfg.Retention).UnixMicro()
		if _, err := r.db.ExecContext(ctx, r.o.q.purge, cut); err != nil && ctx.Err() == nil {
			r.logger.Error("outbox archive purge", err, nil)
		}
	}
}
