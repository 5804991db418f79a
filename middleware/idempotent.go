package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// DefaultLockTimeout bounds how long an attempt waits for another transaction
// that holds the claim of the same event (Config.LockTimeout).
const DefaultLockTimeout = 15 * time.Second

// rollbackTimeout bounds a rollback issued after the message context ended.
const rollbackTimeout = 5 * time.Second

// Config configures the idempotent middleware (NewIdempotent).
type Config struct {
	// Beginner opens each attempt's transaction and claims the event in it:
	// NewPgxBeginner(pool, …) or NewStdBeginner(db). Required.
	Beginner TxBeginner

	// Store is the processed-event store (table and dialect). Defaults to
	// processed.NewStore(processed.Config{}) (table processed_event).
	Store *processed.Store

	// Consumer is the first half of the claim key (consumer, event_id).
	// Defaults to the Watermill handler name of the message's context
	// (message.HandlerNameFromCtx), so two handlers of one service that
	// receive the same event each apply it once. Set it whenever several
	// handlers COMPETE on one queue (workers of one consumer: Watermill
	// requires distinct handler names, which would otherwise give each worker
	// its own key and apply an event once per worker), and to keep the key
	// stable when handler names change. With neither, every message fails
	// with the permanent ErrNoConsumer.
	Consumer string

	// LockTimeout bounds the wait on a claim held by another, uncommitted
	// transaction (two deliveries of one event at once). When it expires the
	// attempt fails with the transient ErrInFlight and is retried later. It
	// is set with SET LOCAL semantics (set_config(…, true)) for the whole
	// attempt's transaction, so a handler statement that waits longer than it
	// on a lock also fails, transiently (SQLSTATE 55P03). Defaults to
	// DefaultLockTimeout; a negative value leaves the session's lock_timeout
	// untouched.
	//
	// Setting it costs one statement per attempt (and PostgreSQL's reset of
	// the setting at the end of the transaction): about 3 % of throughput on
	// a one-INSERT handler (bench/RESULTS.md, experiments). To save it, set
	// lock_timeout on the pool's sessions instead
	// (pgxpool.Config.ConnConfig.RuntimeParams["lock_timeout"] = "15s") and
	// LockTimeout to a negative value; the bound then also applies to every
	// other statement on those connections.
	LockTimeout time.Duration

	// Recorder receives one outcome per attempt (metrics). Defaults to none.
	Recorder Recorder

	// ReplayHorizon is deprecated: set processed.Config.Horizon on Store.
	// The claim statement itself refuses an event older than that horizon
	// by the database clock (OutcomeExpired, permanent), the same clock and
	// event time the purger deletes by, so no clock skew can let a purged
	// event be applied again. When > 0 it must equal the store's horizon
	// (NewIdempotent checks), and it changes nothing else.
	ReplayHorizon time.Duration

	// Now is deprecated and unused: ages are judged by the database clock.
	Now func() time.Time

	// Outbox, when set (recommended), makes the messages a handler produces
	// part of its transaction: those it returns, and those it publishes
	// through PublisherFromContext, are written to this outbox in the same
	// transaction as the claim and the effects, and the middleware returns
	// none to the router. A relay (outbox.NewRelay) publishes them after the
	// commit, at least once, each with the event_id it was written with.
	// Without an outbox, returned messages go back to the router, which
	// publishes them after the commit: a crash or a failed publish in between
	// loses them (the redelivery is a duplicate and produces nothing).
	Outbox *outbox.Outbox

	// OutboxTopic is the destination topic of returned messages written to
	// the outbox. Defaults to the handler's publish topic
	// (message.PublishTopicFromCtx).
	OutboxTopic string
}

func (c *Config) setDefaults() error {
	if c.Store == nil {
		s, err := processed.NewStore(processed.Config{})
		if err != nil {
			return err
		}
		c.Store = s
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = DefaultLockTimeout
	}
	if c.Recorder == nil {
		c.Recorder = nopRecorder{}
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return nil
}

// Validate reports the first invalid field of c, naming it.
func (c Config) Validate() error {
	if c.Beginner == nil {
		return errors.New("middleware: Config.Beginner is required (NewPgxBeginner or NewStdBeginner)")
	}
	if c.ReplayHorizon < 0 {
		return fmt.Errorf("middleware: Config.ReplayHorizon %s: must be ≥ 0", c.ReplayHorizon)
	}
	if c.LockTimeout > 0 && c.LockTimeout < time.Millisecond {
		return fmt.Errorf("middleware: Config.LockTimeout %s: below 1ms", c.LockTimeout)
	}
	return nil
}

// Idempotent is the idempotent-consumer (inbox) middleware. See Middleware.
type Idempotent struct {
	cfg         Config
	logger      watermill.LoggerAdapter
	lockTimeout *lockTimeoutStmt // built once from cfg.LockTimeout

	// topicHandlers remembers, per subscribe topic, the first handler name
	// seen when the consumer defaults to it (see warnSharedTopic).
	topicHandlers sync.Map // topic → handler name
	warned        sync.Map // topic → struct{}
}

// NewIdempotent validates cfg (on a copy with defaults applied) and returns
// the middleware. A nil logger is watermill.NopLogger.
func NewIdempotent(cfg Config, logger watermill.LoggerAdapter) (*Idempotent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if err := checkHorizon(cfg); err != nil {
		return nil, err
	}
	if _, pgxOnly := cfg.Beginner.(*pgxBeginner); pgxOnly && cfg.Store.Dialect() != sqldb.PostgreSQL {
		return nil, fmt.Errorf("middleware: Config.Beginner: the pgx beginner needs a PostgreSQL store, not %s (use NewStdBeginner)", cfg.Store.Dialect())
	}
	return &Idempotent{cfg: cfg, logger: logger, lockTimeout: newLockTimeoutStmt(cfg.Store, cfg.LockTimeout)}, nil
}

// Middleware wraps h so that its effect is applied once per (consumer,
// event_id), however often the message is delivered. Per attempt:
//
//  1. A message flagged malformed by the marshaler, or whose msg.UUID is not
//     a non-nil UUID, fails with a PermanentError before any SQL runs.
//  2. A transaction is begun and (consumer, event_id) claimed in it with one
//     INSERT … ON CONFLICT DO NOTHING (pipelined with BEGIN on pgx).
//  3. Zero rows: a duplicate. The transaction is rolled back, h is not
//     called, nil is returned (the router acks); logged at debug, recorded
//     as OutcomeDuplicate.
//  4. One row: h runs with the transaction in its context (PgxTxFromContext,
//     SQLTxFromContext, QuerierFromContext). If h returns an error or panics,
//     the transaction is rolled back (claim and effects vanish together) and
//     the error is returned, or the panic re-raised, for Retry, PoisonQueue
//     and Recoverer outside. Otherwise the transaction commits; a commit that
//     did not commit is an error wrapping ErrCommit.
//
// The message's context is restored after the attempt, the connection is
// returned to its pool on every path, and each attempt (Watermill's Retry
// calls the chain again with the same message) gets a fresh transaction.
// Messages h returns are returned after the commit, for the router to
// publish: a crash between the commit and that publish loses them.
func (m *Idempotent) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (produced []*message.Message, err error) {
		start := time.Now()
		origCtx := msg.Context()
		consumer := m.cfg.Consumer
		if consumer == "" {
			consumer = message.HandlerNameFromCtx(origCtx)
			m.warnSharedTopic(origCtx, consumer)
		}
		fields := watermill.LogFields{
			"event_id":   msg.UUID,
			"event_name": marshaler.EventName(msg),
			"consumer":   consumer,
			"attempt":    nextAttempt(msg),
		}
		reject := func(o Outcome, reason string, err error) ([]*message.Message, error) {
			err = permanent(reason, err)
			m.finish(consumer, o, start, 0, fields, err)
			return nil, err
		}
		if reason, bad := marshaler.Malformed(msg); bad {
			return reject(OutcomeRejected, "malformed", fmt.Errorf("%w: %s", ErrMalformed, reason))
		}
		if consumer == "" {
			return reject(OutcomeRejected, "no_consumer", ErrNoConsumer)
		}
		eventID, perr := uuid.Parse(msg.UUID)
		if perr != nil || eventID == uuid.Nil {
			return reject(OutcomeRejected, "invalid_event_id", fmt.Errorf("%w: %q", ErrInvalidEventID, msg.UUID))
		}
		fields["event_id"] = eventID.String()
		eventAt, _ := eventTime(msg, eventID)
		tx, claimed, err := m.cfg.Beginner.beginClaim(origCtx, claimRequest{
			store:       m.cfg.Store,
			consumer:    consumer,
			eventID:     eventID,
			eventAt:     eventAt,
			lockTimeout: m.lockTimeout,
		})
		claimDur := time.Since(start)
		if err != nil {
			err = classifyClaimError(err)
			m.finish(consumer, OutcomeFailed, start, claimDur, fields, err)
			return nil, fmt.Errorf("idempotency: begin and claim %s/%s: %w", consumer, eventID, err)
		}
		defer tx.release()

		if !claimed {
			if o, reason, rerr := m.refused(origCtx, tx, consumer, eventID, eventAt, fields); rerr != nil {
				_ = rollback(origCtx, tx)
				if reason == "" { // the verdict itself failed: retry
					m.finish(consumer, OutcomeFailed, start, claimDur, fields, rerr)
					return nil, rerr
				}
				return reject(o, reason, rerr)
			}
			// Nothing was written: end the transaction and ack.
			if rbErr := rollback(origCtx, tx); rbErr != nil {
				m.logger.Debug("Rollback after duplicate failed", fields.Add(watermill.LogFields{"err": rbErr}))
			}
			m.finish(consumer, OutcomeDuplicate, start, claimDur, fields, nil)
			return nil, nil
		}

		crashpoint.Reached(crashpoint.AfterClaim)
		state := &attemptState{consumer: consumer, outcome: OutcomeProcessed, outbox: m.cfg.Outbox, tx: tx}
		msg.SetContext(context.WithValue(tx.bind(origCtx), attemptKey{}, state))
		done := false
		defer func() {
			msg.SetContext(origCtx)
			if done {
				return
			}
			// h panicked: roll back, then let the panic continue outwards.
			r := recover()
			_ = rollback(origCtx, tx)
			m.finish(consumer, OutcomeFailed, start, claimDur, fields, fmt.Errorf("panic: %v", r))
			panic(r)
		}()

		produced, err = h(msg)
		done = true
		if err == nil && m.cfg.Outbox != nil && len(produced) > 0 {
			if err = m.writeOutbox(origCtx, state, produced); err == nil {
				produced = nil
			}
		}
		if err != nil {
			if rbErr := rollback(origCtx, tx); rbErr != nil {
				err = errors.Join(err, fmt.Errorf("idempotency: rollback: %w", rbErr))
			}
			m.finish(consumer, OutcomeFailed, start, claimDur, fields, err)
			return produced, err
		}
		crashpoint.Reached(crashpoint.BeforeCommit)
		if cErr := tx.commit(origCtx); cErr != nil {
			_ = rollback(origCtx, tx)
			err = fmt.Errorf("%w: %s/%s: %w", ErrCommit, consumer, eventID, cErr)
			m.finish(consumer, OutcomeFailed, start, claimDur, fields, err)
			return nil, err
		}
		crashpoint.Reached(crashpoint.AfterCommit)
		m.finish(consumer, state.outcome, start, claimDur, fields, nil)
		return produced, nil
	}
}

// rollback ends tx on a context that survives the message context's
// cancellation (a shutdown must still roll back), bounded by rollbackTimeout.
func rollback(ctx context.Context, tx attemptTx) error {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
	defer cancel()
	return tx.rollback(c)
}

func (m *Idempotent) writeOutbox(ctx context.Context, st *attemptState, msgs []*message.Message) error {
	topic := m.cfg.OutboxTopic
	if topic == "" {
		topic = message.PublishTopicFromCtx(ctx)
	}
	if topic == "" {
		return permanent("no_outbox_topic", errors.New("idempotency: the handler returned messages but neither Config.OutboxTopic nor the handler's publish topic names their destination"))
	}
	pub, err := st.publisher()
	if err != nil {
		return err
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return fmt.Errorf("idempotency: write produced messages to the outbox: %w", err)
	}
	return nil
}

// warnSharedTopic logs once per topic when two handlers with the default
// consumer name (their own names) consume one subscribe topic. That is right
// when each receives its own copy (fan-out: two effects of one event), and
// wrong when they compete for one queue (workers of one consumer: an event
// redelivered to the other worker would be applied again): Config.Consumer
// must then be set.
func (m *Idempotent) warnSharedTopic(ctx context.Context, handler string) {
	topic := message.SubscribeTopicFromCtx(ctx)
	if topic == "" || handler == "" {
		return
	}
	// Load first: on the hot path the topic is known and nothing is stored
	// (LoadOrStore would box the name on every message).
	first, ok := m.topicHandlers.Load(topic)
	if !ok {
		first, ok = m.topicHandlers.LoadOrStore(topic, handler)
	}
	if !ok || first == handler {
		return
	}
	if _, done := m.warned.LoadOrStore(topic, struct{}{}); done {
		return
	}
	m.logger.Error("Several handlers consume one topic with the default consumer name", nil, watermill.LogFields{
		"topic":    topic,
		"handlers": fmt.Sprintf("%s, %s", first, handler),
		"hint":     "if they compete for one queue (workers of one consumer), set middleware.Config.Consumer, or an event redelivered to another worker is applied again; if each gets its own copy (fan-out), this is fine",
	})
}

// MetadataAttempt is the metadata key in which the middleware counts its
// attempts at a message ("1", "2", …): Watermill's Retry re-runs the chain
// with the same message, and the count travels with it to the poison topic.
const MetadataAttempt = "idempotency_attempt"

func nextAttempt(msg *message.Message) int {
	n := 0
	if s := msg.Metadata.Get(MetadataAttempt); s != "" {
		n, _ = strconv.Atoi(s)
	}
	n++
	msg.Metadata.Set(MetadataAttempt, strconv.Itoa(n))
	return n
}

// eventTime is the message's production time: the UUIDv7 timestamp, else
// occurred_at.
func eventTime(msg *message.Message, id uuid.UUID) (time.Time, bool) {
	if id.Version() == 7 {
		sec, nsec := id.Time().UnixTime()
		return time.Unix(sec, nsec), true
	}
	if at, err := marshaler.OccurredAt(msg); err == nil && !at.IsZero() {
		return at, true
	}
	return time.Time{}, false
}

func classifyClaimError(err error) error {
	if IsTransient(err) {
		var pgCode interface{ SQLState() string }
		if errors.As(err, &pgCode) && pgCode.SQLState() == "55P03" {
			return fmt.Errorf("%w: %w", ErrInFlight, err)
		}
		return Transient(err)
	}
	return err
}

func (m *Idempotent) finish(consumer string, o Outcome, start time.Time, claim time.Duration, fields watermill.LogFields, err error) {
	total := time.Since(start)
	m.cfg.Recorder.RecordOutcome(Observation{Consumer: consumer, Outcome: o, Claim: claim, Total: total})
	f := fields.Add(watermill.LogFields{"outcome": string(o), "duration": total})
	switch o {
	case OutcomeProcessed:
		m.logger.Trace("Event processed", f)
	case OutcomeDuplicate, OutcomeStale, OutcomeObsolete:
		m.logger.Debug("Event skipped", f)
	default:
		m.logger.Info("Event not processed", f.Add(watermill.LogFields{"err": err}))
	}
}
