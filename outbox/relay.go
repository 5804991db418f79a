package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

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
	// DefaultPublishTimeout bounds one publish (RelayConfig.PublishTimeout).
	DefaultPublishTimeout = 10 * time.Second
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
	// MaxAttempts bounds the publish attempts of a row that are its own
	// fault: a row whose publish failed MaxAttempts times while the broker
	// accepted its topic (with backoff between them) is moved to the
	// dead-letter table, counted (Recorder.DeadLettered) and logged at
	// ERROR with its row id, event_id and reason, and the relay goes on.
	// Failures are told apart by origin, not by the error's text:
	//   - back-pressure (BackPressure: a nack of a full queue, a full
	//     JetStream stream (marshaler/jetstream.Publisher), a publish
	//     that timed out, a connection the broker blocked) never counts: the
	//     row waits with backoff per topic. A row that can never fit is no
	//     back-pressure: marshaler/amqp.ConfirmedPublisher (default
	//     exchange) reports a nack by the topic's queue while it holds
	//     nothing, marshaler/jetstream.Publisher a row that reaches its
	//     stream's MaxBytes, as the row's failure (below);
	//   - an unroutable row (an error with an Unroutable() bool method
	//     returning true: the mandatory publish of
	//     marshaler/amqp.ConfirmedPublisher came back, ErrUnroutable, no
	//     queue bound to its topic yet; marshaler/jetstream.Publisher found
	//     no stream for its subject) never counts: the row stays, with
	//     backoff per topic, holding back only its topic's later rows, and
	//     each failure is logged at WARN (Error for a logger without Warn)
	//     naming the topic, until a queue is bound to it;
	//   - an outage never counts: when nothing went through after a failure
	//     in its round, probe included (connection refused, every publish
	//     failing, also when the outage began after the round's first
	//     publishes), the rows are left as they are, the relay backs off as
	//     a whole, and the first round after the outage publishes them;
	//   - any other failure counts when the broker took something after it
	//     in the same round (a later row, or else the Probe).
	// So a lone row the broker refuses is dead-lettered after MaxAttempts
	// (the probe shows the broker up), and neither an outage, back-pressure
	// nor a topic with no queue, of any length, dead-letters anything.
	// Defaults to DefaultMaxAttempts.
	MaxAttempts int
	// Probe reports whether the broker takes publishes at all (nil) or not
	// (an error). The relay calls it in a round where publishes failed and
	// none succeeded after them (at most once per round, so at most once
	// per backoff interval during an outage); its answer decides whether
	// those failures are the rows' (counted towards MaxAttempts'
	// dead-lettering) or the broker's (nothing dead-lettered). A probe that fails while the broker
	// is up keeps every failing row waiting: the relay logs each failed
	// probe at ERROR. Defaults to publishing probeMessage()
	// to ProbeTopic through the destination publisher: the same connection,
	// exchange, marshaler and confirms as the rows.
	Probe func(ctx context.Context) error
	// ProbeTopic is the topic the default Probe publishes to. Nothing need
	// be bound to it: an unroutable probe (marshaler/amqp.ErrUnroutable,
	// marshaler/jetstream's subject without a stream: an error with an
	// Unroutable() bool method) is the broker's answer, so the broker is
	// up; a bound queue or stream stores the probes (give it a TTL or a
	// length limit). Defaults to DefaultProbeTopic. Ignored when Probe is
	// set.
	ProbeTopic string
	// PublishTimeout bounds one publish (and one probe): the publish gets a
	// context that expires after it, and the relay waits no longer, even
	// for a publisher that ignores its context (watermill-amqp v3 waits for
	// a confirm without one: a connection the broker blocks, a memory or
	// disk alarm, would hold it forever). A publish that hit the bound is
	// back-pressure (ErrPublishTimeout, not counted against the row); a
	// publisher that has not returned is left behind and the relay
	// publishes nothing more until it returns, keeping its stats and stall
	// warning meanwhile. No database transaction is open during a publish.
	// The relay lease (one relay at a time, Parallel false) lasts two
	// PublishTimeouts: a standby takes over that long after the active
	// relay's process died (at once after Close). The lease's length also
	// bounds each of the relay's database steps (a round's claim and settle
	// transactions, the lease renewal, the housekeeping): a database that
	// stops answering with its connection left open (a partition, a paused
	// VM) fails the round at that deadline, logged at ERROR, and the relay
	// retries with backoff; its rows stay pending. Defaults to
	// DefaultPublishTimeout.
	PublishTimeout time.Duration
	// BackPressure, if set, classifies a publish error as back-pressure
	// (the broker cannot take the message now, e.g. watermill-amqp's
	// "delivery not confirmed" nack of a queue at x-max-length with
	// x-overflow reject-publish): it never counts against the row. Errors
	// that have a BackPressure() bool method returning true (the nack of
	// marshaler/amqp.ConfirmedPublisher, ErrNotConfirmed), ErrPublishTimeout
	// and context.DeadlineExceeded are back-pressure without it. Classify
	// by type or origin, not message text. A nack alone does not tell a
	// full queue from a row larger than the queue's x-max-length-bytes,
	// which waits for good, holding its topic back; ConfirmedPublisher
	// tells them apart on the default exchange.
	BackPressure func(error) bool
	// Permanent, if set, classifies a publish error as permanent (the row can
	// never be published, e.g. the marshaler refuses it): the row is
	// dead-lettered at once. Classify by type or origin, not message text.
	Permanent func(error) bool
	// Parallel lets several relays of the outbox publish at once, each
	// claiming a disjoint batch (SKIP LOCKED) that stays hidden from the
	// others until its round settles it (renewed as the lease is). It gives
	// up order across batches: rows may reach the broker in any order. Default false: one
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
	// warning (Warn if the logger has one, else Error with ErrStalled). A
	// database step of the relay that has not answered for StalledAfter is
	// logged at ERROR with errDatabaseStalled, naming the step, before its
	// deadline (PublishTimeout) fails it. Defaults to DefaultStalledAfter.
	StalledAfter time.Duration
	// Recorder receives the relay's metrics. Defaults to nopRecorder.
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
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.StalledAfter == 0 {
		c.StalledAfter = DefaultStalledAfter
	}
	if c.Recorder == nil {
		c.Recorder = nopRecorder{}
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
		{"Retention", c.Retention}, {"StatsInterval", c.StatsInterval}, {"StalledAfter", c.StalledAfter},
		{"PublishTimeout", c.PublishTimeout}} {
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

// errDatabaseStalled is logged (at ERROR) when one of the relay's database
// steps has not answered for RelayConfig.StalledAfter: the database hangs,
// the relay can neither count nor remove its rows.
var errDatabaseStalled = errors.New("outbox: the relay's database has not answered within the stall threshold")

// ErrPublishTimeout is the reason of a publish (or probe) that did not
// finish within RelayConfig.PublishTimeout: back-pressure, never counted
// against the row.
var ErrPublishTimeout = errors.New("outbox: publish timed out")

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

	// Owned by the Run goroutine.
	owner     string         // this relay's lease token
	lease     time.Duration  // the lease's length: 2 × PublishTimeout
	leasedAt  time.Time      // last time the lease (Parallel: the round's hiding) was taken or renewed
	stuck     chan struct{}  // closed when an abandoned publish returns
	pressure  map[string]int // consecutive back-pressure failures per topic
	nextStats time.Time      // next housekeeping
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
		logger:   o.logger.With(watermill.LogFields{"outbox": o.cfg.Table}),
		running:  make(chan struct{}),
		closing:  make(chan struct{}),
		done:     make(chan struct{}),
		owner:    uuid.NewString(),
		lease:    2 * cfg.PublishTimeout,
		pressure: map[string]int{},
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
	if !r.cfg.Parallel {
		defer r.releaseLease(ctx)
	}
	nextStats := &r.nextStats
	failures := 0
	for {
		r.housekeepingIfDue(ctx, nextStats)
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
		if wait > 0 && !r.sleep(ctx, wait, nextStats) {
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
		case <-r.stuck: // nil (never ready) unless a publish was left behind
			// The publisher returned: the broker takes publishes again, or
			// failed them at last; either way the next round tells.
			t.Stop()
			return true
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

// roundResult is what a round did. down: the broker is taken to be down or
// blocked (every publish failed and so did the probe, or a publish did not
// return within PublishTimeout): the relay backs off as a whole.
type roundResult struct {
	claimed, published, failed int
	down                       bool
}

// verdict is what becomes of a row after its publish.
type verdict int

const (
	unsent     verdict = iota // not tried this round (behind a failed row of its topic, or the round stopped)
	sentOK                    // the broker has it: remove
	rowFault                  // failed while the broker takes its topic: an attempt counts
	pressured                 // back-pressure (full queue, blocked connection, timeout): no attempt counts
	unroutable                // no queue bound to its topic yet: no attempt counts, warned
	brokerOut                 // failed while the broker took nothing after it, probe included: untouched
	permanent                 // can never be published: dead-lettered at once
)

// round is one relay round in three steps, none of which holds a database
// transaction open across a publish:
//
//  1. claim (one short transaction): renew the relay lease (default, one
//     relay at a time) or, with Parallel, hide the claimed rows from the
//     other relays for the lease's length; commit;
//  2. publish each row, each publish bounded by PublishTimeout, with no
//     transaction open;
//  3. settle (one short transaction): remove the published rows, record
//     the failures; commit.
//
// A crash between 2 and 3 leaves the rows pending: they are published again
// (same event_id) by the next round, or after the lease by another relay.
//
// Per-topic order (default, not Parallel): when a row's publish fails, the
// rows of its topic behind it are not published (this round, and while it
// waits for its retry: the claim excludes them), until it is published or
// dead-lettered.
//
// Who is at fault (see RelayConfig.MaxAttempts): a failure counts against
// the row only when the broker accepts its topic: the failure is neither
// back-pressure (BackPressure: a nack of a full queue, a blocked
// connection, a publish that timed out) nor unroutable (no queue bound to
// the topic yet), and the broker took something after it in the same round
// (a later row, or else the probe). Back-pressure and an unroutable row
// delay the row (backoff per topic) without counting; an outage (nothing
// went through after the failure, probe included, even when earlier rows
// of the round did) leaves the rows as they are and the relay backs off as
// a whole.
func (r *Relay) round(ctx context.Context) (res roundResult, err error) {
	if r.stuck != nil {
		select {
		case <-r.stuck:
			r.stuck = nil
		default:
			// A publish of an earlier round is still inside the publisher
			// (it did not return within PublishTimeout): do not pile
			// another one behind it.
			res.down = true
			return res, nil
		}
	}
	var rows []pendingRow
	if err := r.database(ctx, "claim", func(ctx context.Context) (err error) {
		rows, err = r.claimRound(ctx)
		return err
	}); err != nil {
		return res, err
	}
	res.claimed = len(rows)
	if len(rows) == 0 {
		r.cfg.Recorder.Round(0)
		return res, nil
	}

	verdicts := make([]verdict, len(rows))
	blocked := map[string]bool{}
	var sent, stalled int
	lastSent := -1 // the last row of the round the broker took
	for i := range rows {
		row := &rows[i]
		if blocked[row.topic] {
			continue // behind a row of its topic that failed this round
		}
		if !r.hold(ctx, rows) {
			break
		}
		var timedOut bool
		row.err, timedOut = r.bounded(ctx, func(pctx context.Context) error { return r.publish(pctx, row) })
		if ctx.Err() != nil {
			break // closing: settle what went through
		}
		switch {
		case row.err == nil:
			verdicts[i] = sentOK
			sent++
			lastSent = i
			delete(r.pressure, row.topic)
			continue
		case errors.Is(row.err, ErrBadMetadata) || (r.cfg.Permanent != nil && r.cfg.Permanent(row.err)):
			verdicts[i] = permanent
		case timedOut || r.isBackPressure(row.err):
			verdicts[i] = pressured
		case isUnroutable(row.err):
			verdicts[i] = unroutable
		default:
			verdicts[i] = rowFault
		}
		res.failed++
		if !r.cfg.Parallel {
			blocked[row.topic] = true
		}
		if timedOut {
			stalled++
			break // the publisher is stuck: nothing more this round
		}
	}
	res.published = sent
	// A failure the broker took something after is the row's. The others
	// (all of them when nothing went through; those after the last success
	// when the broker went away mid-round): the rows or the broker? Ask the
	// probe.
	faults := 0
	for i, v := range verdicts {
		if v == rowFault && i > lastSent {
			faults++
		}
	}
	brokerUp := false
	if faults > 0 && stalled == 0 && ctx.Err() == nil && r.hold(ctx, rows) {
		perr, timedOut := r.bounded(ctx, r.cfg.Probe)
		switch {
		case ctx.Err() != nil:
		case perr == nil:
			brokerUp = true
		default:
			if timedOut {
				stalled++
			}
			r.logger.Error("outbox relay: publishes and the broker probe failed, taking the broker to be down (nothing is counted against the rows)", perr, watermill.LogFields{"failed_rows": faults})
		}
	}
	if !brokerUp {
		for i, v := range verdicts {
			if v == rowFault && i > lastSent {
				verdicts[i] = brokerOut
			}
		}
	}
	res.down = stalled > 0 || (faults > 0 && !brokerUp)
	if sent > 0 {
		// The broker has these rows; a crash here republishes them.
		crashpoint.Reached(crashpoint.OutboxAfterPublish)
	}
	var dead []*pendingRow
	if err := r.database(ctx, "settle", func(ctx context.Context) (err error) {
		dead, err = r.settle(ctx, rows, verdicts)
		return err
	}); err != nil {
		return res, err
	}
	r.cfg.Recorder.Round(sent)
	bp, _ := r.cfg.Recorder.(BackPressureRecorder)
	for i, v := range verdicts {
		switch v {
		case rowFault, permanent, pressured, unroutable, brokerOut:
			r.cfg.Recorder.PublishFailed(rows[i].topic)
		}
		if v == pressured && bp != nil {
			bp.BackPressured(rows[i].topic)
		}
	}
	for _, row := range dead {
		r.cfg.Recorder.DeadLettered(row.topic)
		r.logger.Error("outbox row dead-lettered", row.err, watermill.LogFields{
			"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": row.attempts,
		})
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

// claimRound is step 1 of a round: the rows to publish, in id order, in a
// transaction committed before any publish. Empty when another relay holds
// the lease (this one stands by) or nothing is due.
func (r *Relay) claimRound(ctx context.Context) (rows []pendingRow, err error) {
	tx, err := r.db.BeginTx(ctx, r.txOpts)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	var held []waitingHead
	if !r.cfg.Parallel {
		leased, err := r.takeLease(ctx, tx)
		if err != nil {
			return nil, err
		}
		if !leased {
			committed = true
			return nil, tx.Commit()
		}
		if held, err = r.waiting(ctx, tx); err != nil {
			return nil, err
		}
	}
	if rows, err = r.claim(ctx, tx, held); err != nil {
		return nil, err
	}
	if r.cfg.Parallel && len(rows) > 0 {
		args := []any{r.lease.Microseconds()}
		for _, row := range rows {
			args = append(args, row.id)
		}
		if _, err := tx.ExecContext(ctx, r.o.q.at(fmt.Sprintf(r.o.q.inFlight, r.o.q.inIDs(2, len(rows)))), args...); err != nil {
			return nil, fmt.Errorf("claim: %w", err)
		}
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	r.leasedAt = time.Now()
	return rows, nil
}

// hold keeps what a round stands on while it publishes: the relay lease
// (default) or, with Parallel, the hiding of the round's rows from the
// other relays (next_try_us, a lease's length ahead). It renews it once a
// third of the lease has passed, before each publish and before the probe:
// each of these is bounded by PublishTimeout, half the lease, so a round of
// slow publishes never outlasts it and another relay never takes rows this
// one is publishing or has published but not yet removed. It returns false,
// logged at ERROR, when it could not renew it (the database failed, the
// lease was taken, or a row's hiding had lapsed): the round stops and
// settles what it did.
func (r *Relay) hold(ctx context.Context, rows []pendingRow) bool {
	if time.Since(r.leasedAt) <= r.lease/3 {
		return true
	}
	var held bool
	err := r.database(ctx, "lease renewal", func(ctx context.Context) (err error) {
		if r.cfg.Parallel {
			held, err = r.rehide(ctx, rows)
		} else {
			held, err = r.renew(ctx)
		}
		return err
	})
	if err != nil || !held {
		if ctx.Err() == nil {
			r.logger.Error("outbox relay: lease lost or not renewed, stopping the round", err, watermill.LogFields{"parallel": r.cfg.Parallel})
		}
		return false
	}
	return true
}

// rehide extends the hiding of a Parallel round's rows by a lease, only
// while it still holds (next_try_us ahead of the database clock): true when
// it held for every row.
func (r *Relay) rehide(ctx context.Context, rows []pendingRow) (bool, error) {
	args := []any{r.lease.Microseconds()}
	for _, row := range rows {
		args = append(args, row.id)
	}
	res, err := r.db.ExecContext(ctx, r.o.q.at(fmt.Sprintf(r.o.q.rehide, r.o.q.inIDs(2, len(rows)))), args...)
	if err != nil {
		return false, fmt.Errorf("hide claimed rows: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("hide claimed rows: %w", err)
	}
	if n == int64(len(rows)) {
		r.leasedAt = time.Now()
	}
	return n == int64(len(rows)), nil
}

// settleTimeout bounds step 3 when the relay is closing (its context done):
// the rows the broker took are still removed.
const settleTimeout = 10 * time.Second

// settle is step 3 of a round: one transaction that removes the published
// rows and records each failure by its verdict. It returns the rows
// dead-lettered.
func (r *Relay) settle(ctx context.Context, rows []pendingRow, verdicts []verdict) (dead []*pendingRow, err error) {
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
		defer cancel()
	}
	var ok []int64
	var release []any
	work := false
	for i, v := range verdicts {
		switch v {
		case sentOK:
			ok = append(ok, rows[i].id)
		case unsent, brokerOut:
			if r.cfg.Parallel {
				release = append(release, rows[i].id)
			}
		}
		work = work || v != unsent && v != brokerOut
	}
	if !work && len(release) == 0 {
		return nil, nil
	}
	tx, err := r.db.BeginTx(ctx, r.txOpts)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if len(ok) > 0 {
		if err := r.remove(ctx, tx, ok); err != nil {
			return nil, err
		}
	}
	if len(release) > 0 {
		if _, err := tx.ExecContext(ctx, fmt.Sprintf(r.o.q.unclaim, r.o.q.inIDs(1, len(release))), release...); err != nil {
			return nil, fmt.Errorf("release rows: %w", err)
		}
	}
	for i, v := range verdicts {
		row := &rows[i]
		switch v {
		case rowFault, permanent:
			isDead, err := r.fail(ctx, tx, row, v == permanent)
			if err != nil {
				return nil, err
			}
			if isDead {
				dead = append(dead, row)
			}
		case pressured, unroutable:
			if err := r.pressured(ctx, tx, row, v == unroutable); err != nil {
				return nil, err
			}
		}
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	return dead, nil
}

// database runs f, one of the relay's database steps (step names it), with
// a context that expires after the lease's length (2 × PublishTimeout): a
// database that stops answering fails the step instead of holding the
// relay for as long as the kernel keeps the connection. If f has not
// returned after StalledAfter, it logs errDatabaseStalled at ERROR, from
// another goroutine (the relay's own is blocked in f).
func (r *Relay) database(ctx context.Context, step string, f func(context.Context) error) error {
	dctx, cancel := context.WithTimeout(ctx, r.lease)
	defer cancel()
	start := time.Now()
	watch := time.AfterFunc(r.cfg.StalledAfter, func() {
		r.logger.Error("outbox relay: the database is not answering", errDatabaseStalled, watermill.LogFields{
			"step": step, "waited": time.Since(start).Round(time.Millisecond).String(), "deadline": r.lease.String(),
		})
	})
	defer watch.Stop()
	err := f(dctx)
	if err != nil && ctx.Err() == nil && errors.Is(dctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("%s: the database did not answer within %s: %w", step, r.lease, err)
	}
	return err
}

// pressured delays row after a back-pressure or unroutable failure, by the
// backoff of its topic's consecutive such failures; its attempts do not
// change. An unroutable row is logged at WARN (Error for a logger without
// Warn), naming its topic and the reason: a queue not bound yet, an
// exchange not declared or forbidden, a misspelt topic.
func (r *Relay) pressured(ctx context.Context, tx wsql.Tx, row *pendingRow, noRoute bool) error {
	n := r.pressure[row.topic]
	r.pressure[row.topic] = n + 1
	reason := truncate(row.err.Error())
	if _, err := tx.ExecContext(ctx, r.o.q.at(r.o.q.pressure), r.backoff(n).Microseconds(), reason, row.id); err != nil {
		return fmt.Errorf("delay row %d: %w", row.id, err)
	}
	if noRoute {
		const msg = "outbox row unroutable: the broker routes its topic to no queue (none bound yet, or its exchange missing or forbidden: see the error); it stays in the outbox, holding back its topic's later rows (not counted against the row), until the topic routes (deploy its consumer, declare the exchange, fix a misspelt topic or the user's permissions)"
		fields := watermill.LogFields{
			"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": row.attempts, "error": reason,
		}
		if w, ok := r.o.logger.(warner); ok {
			fields["outbox"] = r.o.cfg.Table
			w.Warn(msg, fields)
		} else {
			r.logger.Error(msg, row.err, fields)
		}
		return nil
	}
	r.logger.Info("outbox row publish met back-pressure, will retry (not counted against the row)", watermill.LogFields{
		"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": row.attempts, "error": reason,
	})
	return nil
}

// isBackPressure reports whether a publish error is the broker pushing
// back rather than the row's fault (RelayConfig.BackPressure).
func (r *Relay) isBackPressure(err error) bool {
	if errors.Is(err, ErrPublishTimeout) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var bp interface{ BackPressure() bool }
	if errors.As(err, &bp) && bp.BackPressure() {
		return true
	}
	return r.cfg.BackPressure != nil && r.cfg.BackPressure(err)
}

// isUnroutable reports whether a publish error says that nothing routes the
// row's topic yet: no queue bound, no such exchange (an Unroutable() bool
// method returning true, e.g. marshaler/amqp.ErrUnroutable).
func isUnroutable(err error) bool {
	var u interface{ Unroutable() bool }
	return errors.As(err, &u) && u.Unroutable()
}

// bounded runs f (a publish) with a context that expires after
// PublishTimeout, and waits at most that long for it: a publisher that
// ignores the context (blocked inside a connection the broker stopped
// reading) is left behind, the next rounds publish nothing until it
// returns (Relay.stuck), and the relay's housekeeping (stats, stall
// warning) goes on meanwhile. timedOut reports that the bound was hit.
func (r *Relay) bounded(ctx context.Context, f func(context.Context) error) (err error, timedOut bool) {
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	done := make(chan error, 1)
	go func() { done <- f(pctx) }()
	timer := time.NewTimer(r.cfg.PublishTimeout)
	defer timer.Stop()
	tick := time.NewTicker(r.cfg.StatsInterval)
	defer tick.Stop()
	abandon := func() {
		stuck := make(chan struct{})
		go func() {
			<-done
			cancel()
			close(stuck)
		}()
		r.stuck = stuck
	}
	for {
		select {
		case err := <-done:
			cancel()
			if err != nil && ctx.Err() == nil && errors.Is(pctx.Err(), context.DeadlineExceeded) {
				err = fmt.Errorf("%w (%s): %w", ErrPublishTimeout, r.cfg.PublishTimeout, err)
				r.logger.Error("outbox relay: publish timed out (broker blocked or not confirming?); back-pressure, not counted against the row", err, nil)
				return err, true
			}
			return err, false
		case <-timer.C:
			abandon()
			err := fmt.Errorf("%w (%s): the publisher has not returned", ErrPublishTimeout, r.cfg.PublishTimeout)
			r.logger.Error("outbox relay: publish did not return (broker blocked?); no more publishes until it does, nothing counted against the row", err, nil)
			return err, true
		case <-ctx.Done():
			abandon()
			return ctx.Err(), false
		case <-tick.C:
			r.housekeepingIfDue(ctx, &r.nextStats)
		}
	}
}

func truncate(reason string) string {
	// Valid UTF-8 without NUL always, cut at a rune's start: PostgreSQL (22021) and
	// MariaDB in strict mode (1366) refuse a split character, and the
	// settle transaction that writes the reason would roll back with the
	// round's deletes, so its published rows went out again every round.
	reason = strings.ReplaceAll(strings.ToValidUTF8(reason, "\uFFFD"), "\x00", "")
	if len(reason) > maxReason {
		cut := maxReason
		for cut > 0 && !utf8.RuneStart(reason[cut]) {
			cut--
		}
		return reason[:cut] + "… (truncated)"
	}
	return reason
}

// waitingHead is the oldest row of a topic waiting for its retry: the rows
// of its topic behind it are held back (per-topic order).
type waitingHead struct {
	id    int64
	topic string
}

// waiting returns, per topic, the oldest row waiting for its retry.
func (r *Relay) waiting(ctx context.Context, tx wsql.Tx) ([]waitingHead, error) {
	rows, err := tx.QueryContext(ctx, r.o.q.at(r.o.q.waiting))
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
	if err := closeRows(rows); err != nil {
		return nil, fmt.Errorf("waiting rows: %w", err)
	}
	return out, nil
}

// takeLease takes or renews the relay lease in tx; false means another
// relay holds it (this one stands by). A lease not renewed for its length
// (RelayConfig.PublishTimeout × 2) is taken over: that long after a relay
// process dies, a standby takes its place.
func (r *Relay) takeLease(ctx context.Context, tx wsql.Tx) (bool, error) {
	res, err := tx.ExecContext(ctx, r.o.q.at(r.o.q.lease), r.owner, r.lease.Microseconds(), r.owner)
	if err != nil {
		return false, fmt.Errorf("relay lease: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("relay lease: %w", err)
	}
	return n == 1, nil
}

// renew renews the lease between publishes (no transaction open); false
// means another relay took it over.
func (r *Relay) renew(ctx context.Context) (bool, error) {
	res, err := r.db.ExecContext(ctx, r.o.q.at(r.o.q.lease), r.owner, r.lease.Microseconds(), r.owner)
	if err != nil {
		return false, fmt.Errorf("relay lease: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("relay lease: %w", err)
	}
	if n == 1 {
		r.leasedAt = time.Now()
	}
	return n == 1, nil
}

// releaseLease gives the lease up when the relay stops, so that a standby
// takes over at its next round.
func (r *Relay) releaseLease(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	if _, err := r.db.ExecContext(ctx, r.o.q.release, r.owner); err != nil {
		r.logger.Error("outbox relay: release the lease", err, nil)
	}
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
		return r.scanRows(tx.QueryContext(ctx, r.o.q.at(fmt.Sprintf(r.o.q.claim, exclude, r.cfg.BatchSize)), args...))
	}
	type candidate struct {
		id    int64
		topic string
	}
	rows, err := tx.QueryContext(ctx, r.o.q.at(fmt.Sprintf(r.o.q.peek, exclude, r.cfg.BatchSize)), args...)
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
	if err := closeRows(rows); err != nil {
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
	if err := closeRows(rows); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return out, nil
}

// probeEventName is the event name of probeMessage.
const probeEventName = "outbox.probe"

// MetadataProbe is set ("true") on probeMessage: a consumer of the probe
// topic can tell probes apart and drop them.
const MetadataProbe = "outbox_probe"

// probeMessage returns a new probe message: a valid envelope
// (marshaler.NewMessage, a fresh UUIDv7 event id, event name
// probeEventName, payload {"probe":true}) with metadata MetadataProbe
// "true", so envelope-checking marshalers take it.
func probeMessage() (*message.Message, error) {
	m, err := marshaler.NewMessage(probeEventName, map[string]bool{"probe": true})
	if err != nil {
		return nil, err
	}
	m.Metadata.Set(MetadataProbe, "true")
	return m, nil
}

// publishProbe is the default RelayConfig.Probe: probeMessage to topic
// through dest.
func publishProbe(dest message.Publisher, topic string) func(context.Context) error {
	return func(ctx context.Context) error {
		m, err := probeMessage()
		if err != nil {
			return err
		}
		m.SetContext(ctx)
		if err := dest.Publish(topic, m); err != nil && !isUnroutable(err) {
			// Unroutable is the broker's answer (RabbitMQ confirmed and
			// returned the probe: no queue is bound to its topic;
			// JetStream: no stream takes its subject): the broker is up,
			// which is all the probe asks. Nothing needs binding there.
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
		if _, err := tx.ExecContext(ctx, r.o.q.at(r.o.q.archive(len(ids))), args...); err != nil {
			return fmt.Errorf("archive: %w", err)
		}
	}
	if _, err := tx.ExecContext(ctx, r.o.q.delete(len(ids)), args...); err != nil {
		return fmt.Errorf("delete relayed: %w", err)
	}
	return nil
}

// fail records a failed publish of row that is the row's own (the broker
// takes its topic): another attempt later, or the dead-letter table after
// MaxAttempts, at once when permanent. It reports whether the row was
// dead-lettered.
func (r *Relay) fail(ctx context.Context, tx wsql.Tx, row *pendingRow, permanent bool) (bool, error) {
	attempts := row.attempts + 1
	row.attempts = attempts
	reason := truncate(row.err.Error())
	if permanent || attempts >= r.cfg.MaxAttempts {
		return true, r.deadLetter(ctx, tx, row, attempts, reason)
	}
	backoff := r.backoff(attempts - 1).Microseconds()
	if _, err := tx.ExecContext(ctx, r.o.q.at(r.o.q.retry()), attempts, backoff, reason, row.id); err != nil {
		return false, fmt.Errorf("retry row %d: %w", row.id, err)
	}
	r.logger.Info("outbox row publish failed, will retry", watermill.LogFields{
		"row_id": row.id, "event_id": row.eventID, "topic": row.topic, "attempts": attempts, "error": reason,
	})
	return false, nil
}

// deadLetter moves row to the dead-letter table.
func (r *Relay) deadLetter(ctx context.Context, tx wsql.Tx, row *pendingRow, attempts int, reason string) error {
	if _, err := tx.ExecContext(ctx, r.o.q.at(r.o.q.deadLetter()), attempts, reason, row.id); err != nil {
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
	var n int
	var age time.Duration
	err := r.database(ctx, "stats", func(ctx context.Context) (err error) {
		n, age, err = r.o.stats(ctx, r.db)
		return err
	})
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
		// In batches, each within the step's deadline, at most
		// archivePurgeBatches a round of housekeeping: a backlog goes
		// over the next rounds, and delivery is never held long.
		for i := 0; i < archivePurgeBatches; i++ {
			var n int64
			err := r.database(ctx, "archive purge", func(ctx context.Context) error {
				res, err := r.db.ExecContext(ctx, r.o.q.at(r.o.q.purge), r.cfg.Retention.Microseconds(), archivePurgeBatch)
				if err == nil {
					n, err = res.RowsAffected()
				}
				return err
			})
			if err != nil {
				if ctx.Err() == nil {
					r.logger.Error("outbox archive purge", err, nil)
				}
				return
			}
			if n < archivePurgeBatch {
				return
			}
		}
	}
}

// archivePurgeBatch is the archived rows one purge statement deletes at
// most; archivePurgeBatches the statements one round of housekeeping
// (every StatsInterval) runs at most.
const (
	archivePurgeBatch   = 5000
	archivePurgeBatches = 20
)
