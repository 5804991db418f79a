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
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
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
	// DefaultProbeTopic is the default probe's topic (RelayConfig.ProbeTopic).
	DefaultProbeTopic = "outbox.probe"
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
	// MaxAttempts bounds the publish attempts of a row the broker is up
	// for: a row whose publish failed MaxAttempts times (with backoff
	// between them) is moved to the dead-letter table, counted
	// (Recorder.DeadLettered) and logged at ERROR with its row id, event_id
	// and reason, and the relay goes on. Failures are told apart by origin,
	// not by the error's text: an attempt counts against the row when the
	// broker took something else in the same round (another row, or else
	// the Probe); when nothing went through, probe included, the broker is
	// taken to be down (connection refused, every publish failing) and no
	// row is dead-lettered, however long the outage: rows keep waiting with
	// backoff capped at MaxBackoff, the relay backs off as a whole, and the
	// first round after the outage publishes them. So a lone failing row
	// with nothing behind it is dead-lettered after MaxAttempts too (the
	// probe shows the broker up), and an outage dead-letters nothing.
	// Defaults to DefaultMaxAttempts.
	MaxAttempts int
	// Probe reports whether the broker takes publishes at all (nil) or not
	// (an error). The relay calls it in a round where publishes failed and
	// none succeeded (at most once per round, so at most once per backoff
	// interval during an outage); its answer decides whether those failures
	// are the rows' (counted towards MaxAttempts' dead-lettering) or the
	// broker's (nothing dead-lettered). A probe that fails while the broker
	// is up (a wrong ProbeTopic) keeps every failing row waiting: the relay
	// logs each failed probe at ERROR. Defaults to publishing ProbeMessage()
	// to ProbeTopic through the destination publisher: the same connection,
	// exchange, marshaler and confirms as the rows.
	Probe func(ctx context.Context) error
	// ProbeTopic is the topic the default Probe publishes to. The broker
	// must accept a publish there while it is up: with a publisher that
	// fails unroutable messages (mandatory publish, e.g.
	// marshaler/amqp.PoisonPublisher) bind a queue to it (with a message
	// TTL or length limit); plain watermill-amqp drops an unroutable probe
	// and reports success, which is what is wanted. Defaults to
	// DefaultProbeTopic. Ignored when Probe is set.
	ProbeTopic string
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
	// a stalled outbox and purges the archive, also while the relay backs
	// off (up to MaxBackoff) behind a down broker. Defaults to
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
	if c.ProbeTopic == "" {
		c.ProbeTopic = DefaultProbeTopic
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
}

// NewRelay validates cfg (on a copy with defaults applied) and returns a
// relay of the outbox (on its Config.DB) to dest (for example a watermill-amqp publisher
// with confirms: a nil error from Publish must mean "the broker has it").
// The relay does not close dest. It does not start (Run).
func (o *Outbox) NewRelay(dest message.Publisher, cfg RelayConfig) (*Relay, error) {
	db := o.beginner()
	if dest == nil {
		return nil, errors.New("outbox: NewRelay: destination publisher is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Parallel && o.dialect == sqldb.SQLite {
		return nil, errors.New("outbox: RelayConfig.Parallel: not supported on SQLite (one writer)")
	}
	cfg.setDefaults()
	if cfg.Probe == nil {
		cfg.Probe = publishProbe(dest, cfg.ProbeTopic)
	}
	r := &Relay{
		o: o, db: db, dest: dest, cfg: cfg,
		logger:  o.logger.With(watermill.LogFields{"outbox": o.cfg.Table}),
		running: make(chan struct{}),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}
	if o.dialect != sqldb.SQLite {
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
		r.housekeepingIfDue(ctx, &nextStats)
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
		case res.down:
			wait = r.backoff(failures) // the broker is down
			failures++
		case res.claimed == r.cfg.BatchSize:
			failures = 0
		default:
			wait = r.cfg.PollInterval
			failures = 0
		}
		if wait > 0 && !r.sleep(ctx, wait, &nextStats) {
			return nil
		}
	}
}

// sleep waits d, keeping the housekeeping (stats, stall warning, archive
// purge) on its StatsInterval meanwhile: a relay backing off for up to
// MaxBackoff behind a down broker or a refused row still reports its
// pending rows and warns that they stall, which is when the warning
// matters. It returns false when ctx is done.
func (r *Relay) sleep(ctx context.Context, d time.Duration, nextStats *time.Time) bool {
	deadline := time.Now().Add(d)
	for {
		until := deadline
		if nextStats.Before(until) {
			until = *nextStats
		}
		t := time.NewTimer(time.Until(until))
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
		if !time.Now().Before(deadline) {
			return true
		}
		r.housekeepingIfDue(ctx, nextStats)
	}
}

// housekeepingIfDue runs the housekeeping when *next has passed and sets
// *next one StatsInterval later.
func (r *Relay) housekeepingIfDue(ctx context.Context, next *time.Time) {
	if now := time.Now(); !now.Before(*next) {
		r.housekeeping(ctx)
		*next = now.Add(r.cfg.StatsInterval)
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
	id       int64
	eventID  string
	topic    string
	payload  []byte
	metadata string
	attempts int
	err      error
}

// roundResult is what a round did. down: some publish failed and the
// broker did not take anything this round, the probe included.
type roundResult struct {
	claimed, published, failed int
	down                       bool
}

// round is one relay transaction: lock, claim, publish, remove, commit.
//
// Per-topic order (default, not Parallel): when a row's publish fails, the
// rows of its topic behind it are not published (this round, and while it
// waits for its retry: the claim excludes them), until it is published or
// dead-lettered.
//
// Who is at fault (see RelayConfig.MaxAttempts): a failed row is the row's
// fault only when the broker took something in the same round: another
// row, or else the probe (RelayConfig.Probe), which the round publishes
// once when rows failed and none succeeded. A row that failed
// MaxAttempts times and is the row's fault is dead-lettered; while the
// broker takes nothing (an outage: connection refused, every publish
// failing) nothing is dead-lettered, rows keep their backoff, and the
// relay backs off as a whole (res.down).
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
	var held []waitingHead
	if !r.cfg.Parallel {
		locked, err := r.lock(ctx, tx)
		if err != nil || !locked {
			return res, err
		}
		if held, err = r.waiting(ctx, tx); err != nil {
			return res, err
		}
	}
	rows, err := r.claim(ctx, tx, held)
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
	var failed []*pendingRow
	blocked := map[string]bool{}
	for i := range rows {
		row := &rows[i]
		if blocked[row.topic] {
			continue // behind a row of its topic that failed this round
		}
		if row.err = r.publish(ctx, row); row.err != nil {
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			res.failed++
			failed = append(failed, row)
			if !r.cfg.Parallel {
				blocked[row.topic] = true
			}
			continue
		}
		ok = append(ok, row.id)
	}
	res.published = len(ok)
	for _, row := range failed {
		r.cfg.Recorder.PublishFailed(row.topic)
	}
	brokerUp := len(ok) > 0
	if len(failed) > 0 && !brokerUp {
		// Nothing went through: the rows or the broker? Ask the probe.
		if perr := r.cfg.Probe(ctx); perr != nil {
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			r.logger.Error("outbox relay: publishes and the broker probe failed, taking the broker to be down (nothing is dead-lettered)", perr, watermill.LogFields{"failed_rows": len(failed)})
		} else {
			brokerUp = true
		}
	}
	res.down = len(failed) > 0 && !brokerUp
	if len(ok) > 0 {
		// The broker has these rows; a crash here republishes them.
		crashpoint.Reached(crashpoint.OutboxAfterPublish)
		if err := r.remove(ctx, tx, ok); err != nil {
			return res, err
		}
	}
	var dead []*pendingRow
	for _, row := range failed {
		isDead, err := r.fail(ctx, tx, row, brokerUp)
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
			"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": row.attempts,
		})
	}
	return res, nil
}

// waitingHead is the oldest row of a topic waiting for its retry: the rows
// of its topic behind it are held back (per-topic order).
type waitingHead struct {
	id    int64
	topic string
}

// waiting returns, per topic, the oldest row waiting for its retry.
func (r *Relay) waiting(ctx context.Context, tx wsql.Tx) ([]waitingHead, error) {
	rows, err := tx.QueryContext(ctx, r.o.q.waiting)
	if err != nil {
		return nil, fmt.Errorf("waiting rows: %w", err)
	}
	var out []waitingHead
	seen := map[string]bool{}
	for rows.Next() {
		var h waitingHead
		if err := rows.Scan(&h.id, &h.topic); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("waiting rows: %w", err)
		}
		if !seen[h.topic] {
			seen[h.topic] = true
			out = append(out, h)
		}
	}
	if err := rows.Close(); err != nil {
		return nil, fmt.Errorf("waiting rows: %w", err)
	}
	return out, nil
}

// lock takes the outbox's relay lock for this transaction; false means
// another relay holds it (this one stands by).
func (r *Relay) lock(ctx context.Context, tx wsql.Tx) (bool, error) {
	if r.o.dialect == sqldb.SQLite {
		res, err := tx.ExecContext(ctx, r.o.q.lock)
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

// claim returns the rows this round publishes, in id order, locked.
//
// Parallel (and SQLite, one writer): the oldest due rows not locked by
// another relay (FOR UPDATE SKIP LOCKED). Default (one active relay, per
// topic order): SKIP LOCKED alone would skip a committed row that some
// other session holds a row lock on (an operator's SELECT … FOR UPDATE, a
// foreign key check) and publish the rows of its topic behind it first. So
// the candidates are read without locks (a committed row is visible
// whoever locks it), then locked by id with SKIP LOCKED; a candidate that
// could not be locked holds back the candidates of its topic behind it this
// round, and is claimed by a later round once its lock is gone. Other
// topics go on; nothing waits for the other session.
func (r *Relay) claim(ctx context.Context, tx wsql.Tx, held []waitingHead) ([]pendingRow, error) {
	var args []any
	for _, h := range held {
		args = append(args, h.topic, h.id)
	}
	exclude := r.o.q.holdBack(1, len(held))
	if r.cfg.Parallel || r.o.dialect == sqldb.SQLite {
		return r.scanRows(tx.QueryContext(ctx, fmt.Sprintf(r.o.q.claim, exclude, r.cfg.BatchSize), args...))
	}
	type candidate struct {
		id    int64
		topic string
	}
	rows, err := tx.QueryContext(ctx, fmt.Sprintf(r.o.q.peek, exclude, r.cfg.BatchSize), args...)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	var cands []candidate
	for rows.Next() {
		var c candidate
		if err := rows.Scan(&c.id, &c.topic); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("claim: scan: %w", err)
		}
		cands = append(cands, c)
	}
	if err := rows.Close(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	if len(cands) == 0 {
		return nil, nil
	}
	ids := make([]any, len(cands))
	for i, c := range cands {
		ids[i] = c.id
	}
	locked, err := r.scanRows(tx.QueryContext(ctx, fmt.Sprintf(r.o.q.lockIDs, r.o.q.inIDs(1, len(ids))), ids...))
	if err != nil {
		return nil, err
	}
	if len(locked) == len(cands) {
		return locked, nil
	}
	byID := make(map[int64]pendingRow, len(locked))
	for _, p := range locked {
		byID[p.id] = p
	}
	blocked := map[string]bool{}
	out := locked[:0:0]
	for _, c := range cands {
		p, ok := byID[c.id]
		switch {
		case blocked[c.topic]:
		case !ok:
			blocked[c.topic] = true // locked by another session: its topic waits
		default:
			out = append(out, p)
		}
	}
	return out, nil
}

func (r *Relay) scanRows(rows wsql.Rows, err error) ([]pendingRow, error) {
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	var out []pendingRow
	for rows.Next() {
		var p pendingRow
		if err := rows.Scan(&p.id, &p.eventID, &p.topic, &p.payload, &p.metadata, &p.attempts); err != nil {
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

// ProbeEventName is the event name of ProbeMessage.
const ProbeEventName = "outbox.probe"

// MetadataProbe is set ("true") on ProbeMessage: a consumer of the probe
// topic can tell probes apart and drop them.
const MetadataProbe = "outbox_probe"

// ProbeMessage returns a new probe message: a valid envelope
// (marshaler.NewMessage, a fresh UUIDv7 event id, event name
// ProbeEventName, payload {"probe":true}) with metadata MetadataProbe
// "true", so envelope-checking marshalers take it.
func ProbeMessage() (*message.Message, error) {
	m, err := marshaler.NewMessage(ProbeEventName, map[string]bool{"probe": true})
	if err != nil {
		return nil, err
	}
	m.Metadata.Set(MetadataProbe, "true")
	return m, nil
}

// publishProbe is the default RelayConfig.Probe: ProbeMessage to topic
// through dest.
func publishProbe(dest message.Publisher, topic string) func(context.Context) error {
	return func(ctx context.Context) error {
		m, err := ProbeMessage()
		if err != nil {
			return err
		}
		m.SetContext(ctx)
		if err := dest.Publish(topic, m); err != nil {
			return fmt.Errorf("outbox: probe publish to %q: %w", topic, err)
		}
		return nil
	}
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
	args := make([]any, 0, len(ids))
	for _, id := range ids {
		args = append(args, id)
	}
	if r.cfg.Retention > 0 {
		if _, err := tx.ExecContext(ctx, r.o.q.archive(len(ids)), args...); err != nil {
			return fmt.Errorf("archive: %w", err)
		}
	}
	if _, err := tx.ExecContext(ctx, r.o.q.delete(len(ids)), args...); err != nil {
		return fmt.Errorf("delete relayed: %w", err)
	}
	return nil
}

// fail records a failed publish of row: another attempt later, or the
// dead-letter table. brokerUp: the broker took something this round (a row
// or the probe), so the failure is the row's. It reports whether the row was
// dead-lettered.
func (r *Relay) fail(ctx context.Context, tx wsql.Tx, row *pendingRow, brokerUp bool) (bool, error) {
	attempts := row.attempts + 1
	row.attempts = attempts
	permanent := errors.Is(row.err, ErrBadMetadata) || (r.cfg.Permanent != nil && r.cfg.Permanent(row.err))
	reason := row.err.Error()
	if len(reason) > maxReason {
		reason = reason[:maxReason] + "… (truncated)"
	}
	if permanent || (attempts >= r.cfg.MaxAttempts && brokerUp) {
		return true, r.deadLetter(ctx, tx, row, attempts, reason)
	}
	backoff := r.backoff(attempts - 1).Microseconds()
	if _, err := tx.ExecContext(ctx, r.o.q.retry(), attempts, backoff, reason, row.id); err != nil {
		return false, fmt.Errorf("retry row %d: %w", row.id, err)
	}
	r.logger.Info("outbox row publish failed, will retry", watermill.LogFields{
		"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": attempts, "error": reason,
		"broker_up": brokerUp,
	})
	return false, nil
}

// deadLetter moves row to the dead-letter table.
func (r *Relay) deadLetter(ctx context.Context, tx wsql.Tx, row *pendingRow, attempts int, reason string) error {
	if _, err := tx.ExecContext(ctx, r.o.q.deadLetter(), attempts, reason, row.id); err != nil {
		return fmt.Errorf("dead-letter row %d: %w", row.id, err)
	}
	if _, err := tx.ExecContext(ctx, r.o.q.delete(1), row.id); err != nil {
		return fmt.Errorf("dead-letter row %d: %w", row.id, err)
	}
	return nil
}

type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// housekeeping reports pending rows, warns about a stalled outbox and
// purges the archive. Errors are logged; the relay goes on.
func (r *Relay) housekeeping(ctx context.Context) {
	n, age, err := r.o.stats(ctx, r.db)
	if err != nil {
		if ctx.Err() == nil {
			r.logger.Error("outbox stats", err, nil)
		}
		return
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
		if _, err := r.db.ExecContext(ctx, r.o.q.purge, r.cfg.Retention.Microseconds()); err != nil && ctx.Err() == nil {
			r.logger.Error("outbox archive purge", err, nil)
		}
	}
}
