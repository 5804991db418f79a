// Package outbox is a transactional outbox: a producer writes messages into
// an outbox table in its own transaction (Publisher), and a relay (Relay)
// publishes the committed rows to the broker and deletes them.
//
// # Producer
//
// A message written through Publisher exists if and only if the producer's
// transaction commits. Its UUID (the event_id) is fixed when it is written, so
// every send of the row carries the same event_id.
//
// # Relay: why a row that commits late is never skipped
//
// The relay keeps no read position. Each round claims the oldest pending
// rows in one short transaction (SELECT … ORDER BY id … FOR UPDATE SKIP
// LOCKED LIMIT n under READ COMMITTED), publishes them with no transaction
// open, then deletes them (or moves them to the archive) in a second short
// transaction. A row of a transaction still open
// is invisible to the claim and is simply claimed by a later round once it
// commits: there is no offset to move past it, so it cannot be skipped, and
// no open transaction anywhere on the server (another database, the same
// one, any length of time) holds back rows that are already committed. This
// is unlike watermill-sql's PostgreSQL schema, which reads only below
// pg_snapshot_xmin(pg_current_snapshot()) and so stops every relay on the
// server while any write transaction is open (ThreeDotsLabs/watermill#311).
//
// At least once: a row is deleted only in the transaction that follows its
// publish, so a crash between publish and delete leaves the row pending and
// a later round publishes it again with the same event_id; consumers
// deduplicate (that is the idempotent middleware's job).
//
// # Order and several relays
//
// By default a relay round first takes or renews the outbox's relay lease
// (an UPDATE of the <table>_relay row naming the relay, valid for two
// RelayConfig.PublishTimeouts, renewed between publishes): one relay
// publishes at a time, the others stand by and take over as soon as it
// stops (Close gives the lease up), or when its lease expires (its process
// died), so rows are published in id order. For two rows of the same topic written by transactions that
// followed each other (the second began after the first committed, e.g. both
// updated the same aggregate row), id order is write order. Rows of
// concurrent transactions are published in the order they become visible by
// id. A row whose publish fails holds back the rows of its topic behind it
// until it is published or dead-lettered (per-topic order); other topics go
// on. A committed row that another session holds a row lock on (SELECT …
// FOR UPDATE) is not skipped past: the relay reads its candidates without
// locks, then locks them with SKIP LOCKED, and a candidate it could not
// lock holds back its topic until the lock is gone (other topics go on). RelayConfig.Parallel lets relays claim disjoint batches at once (SKIP
// LOCKED), giving up order across batches (and the hold-back).
//
// # Failures, dead letters, retention
//
// Back-pressure is not failure: a publish is bounded by
// RelayConfig.PublishTimeout (a broker that blocks the connection holds no
// transaction open and shows as a stall: the oldest pending row's age in
// the stats and the stall warning keep being reported), and a timeout, a
// nack of a full queue (RelayConfig.BackPressure; not a row its queue or
// stream can never hold, which the publishers of marshaler/amqp on the
// default exchange and marshaler/jetstream report as the row's own
// failure, so that it is dead-lettered), an unroutable row (no
// queue bound to its topic yet: an error with an Unroutable() bool method,
// marshaler/amqp.ErrUnroutable; the row stays, holding back its topic, and
// is logged at WARN with its topic) or an outage never counts against a
// row. A row whose own publish fails is retried with exponential backoff
// (RelayConfig.RetryInterval doubling up to MaxBackoff) and, after
// RelayConfig.MaxAttempts failed attempts while the broker takes its topic, moved to
// the dead-letter table (<table>_dead, with the reason), counted
// (Recorder.DeadLettered) and logged at ERROR with its row id, event_id and
// reason; the relay goes on with the rest. Whose fault a failure is comes
// from its origin, not its text: a publish that failed and was followed in
// its round by one the broker took (a later row, or else the probe:
// RelayConfig.Probe, by default a probe message published through the same
// publisher) shows the broker up, so the failure is the row's (a marshaler
// that refuses it, a header the broker rejects). When nothing went through
// after a failure, probe included, it is an outage (connection refused,
// every publish failing, also from the middle of a round on): no row is
// dead-lettered however long it lasts,
// rows wait with capped backoff, and the relay backs off as a whole. So a
// lone bad row with no other row behind it is dead-lettered after
// MaxAttempts, and an outage never empties the outbox into the dead-letter
// table. RelayConfig.Permanent dead-letters a row at its first failure.
// Relayed rows leave the outbox table in the round that publishes them: at
// rest it holds only pending rows. With RelayConfig.Retention > 0 they are
// kept in the archive table (<table>_relayed) for that long, for Replay.
// Redrive moves dead-lettered rows back to pending, attempts reset.
//
// # Clocks
//
// Every time the outbox stores or compares (a row's write time, its next
// retry, dead-letter and relay times, the age of the oldest pending row,
// the archive's retention) is read from the database server's clock in UTC
// microseconds, in the SQL statement itself: producers and relays in
// several processes whose clocks disagree, and sessions in any time zone
// (PostgreSQL TimeZone, MySQL time_zone), compare one clock. A relay whose
// clock is an hour off neither starves the others' retries (next try an
// hour late) nor hot-loops them (an hour early), nor reports a wrong age.
// Process clocks only pace a relay's own loop (poll interval, backoff
// waits). On SQLite the database is in-process, so its clock is the
// process's: read in Go (time.Now, microseconds) for each statement, never
// SQLite's julianday('now'), which has millisecond resolution and read
// earlier than a Go clock read just before the write.
package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/internal/outboxdb"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/wire"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// DefaultTable is the outbox table when Config.Table is empty.
const DefaultTable = "outbox"

// Config configures an Outbox.
type Config struct {
	// Table is the outbox table, optionally schema-qualified ("app.outbox");
	// letters, digits and '_' per part. The relay's other tables are named
	// after it: <table>_dead (dead letters), <table>_relayed (archive),
	// <table>_relay (the relay lock row). Defaults to DefaultTable.
	Table string
	// DB is the outbox's database (idempotency.Pgx or idempotency.SQL): the
	// one the producer's transactions and the consumer run on. Migrate,
	// the relay and the counts use it; Publisher writes on the caller's
	// transaction of it. Required.
	DB idempotency.DB
	// PublisherDecorators wrap every publisher Publisher returns, outermost
	// last, as Watermill's router applies its publisher decorators: use the
	// same decorators as the router's (trace context injection, metrics) so
	// messages written to the outbox carry what directly published ones do.
	// What a decorator writes into the metadata is stored and relayed.
	PublisherDecorators []message.PublisherDecorator
}

// Validate reports the first invalid field, naming it.
func (c Config) Validate() error {
	if c.Table != "" {
		if _, err := sqldb.ParseIdent(c.Table); err != nil {
			return fmt.Errorf("outbox: Config.Table %q: %w", c.Table, err)
		}
	}
	h, err := sqldb.HandleOf(c.DB)
	if err != nil {
		return fmt.Errorf("outbox: Config.DB: %w", err)
	}
	if err := h.Dialect.Validate(); err != nil {
		return fmt.Errorf("outbox: Config.DB: %w", err)
	}
	return nil
}

// Outbox writes to, relays from and replays one outbox table. Safe for
// concurrent use.
type Outbox struct {
	cfg     Config
	db      *sqldb.Handle
	dialect sqldb.Dialect
	logger  watermill.LoggerAdapter
	q       queries
	// mode is the pgx exec mode of the outbox's statements on a pgx
	// handle (sqldb.OwnMode), nil for the pool's default or database/sql.
	mode any
	// now is the process clock (time.Now). Nothing stored or compared
	// reads it (the database clock does, queries.dbNow); tests skew it
	// (export_test.go) to show that a wrong process clock changes nothing.
	now func() time.Time
}

// New validates cfg (a copy, defaults applied). A nil logger is NopLogger.
func New(cfg Config, logger watermill.LoggerAdapter) (*Outbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	h, _ := sqldb.HandleOf(cfg.DB)
	names, err := tableNames(cfg.Table, h.Dialect)
	if err != nil {
		return nil, err
	}
	o := &Outbox{cfg: cfg, db: h, dialect: h.Dialect, logger: logger, q: newQueries(h.Dialect, names), now: time.Now,
		mode: h.OwnMode()}
	return o, nil
}

func init() {
	outboxdb.HandleOf = func(v any) *sqldb.Handle {
		if o, ok := v.(*Outbox); ok && o != nil {
			return o.db
		}
		return nil
	}
}

// Table is the outbox table's name as configured (unquoted).
func (o *Outbox) Table() string { return o.cfg.Table }

// Publisher returns a publisher that writes into the outbox through tx (a
// transaction: wsql.TxFromPgx, wsql.TxFromStdSQL, or anything with
// ExecContext/QueryContext). Publish(topic, msgs…) stores each message for
// destination topic with its UUID, payload and metadata; nothing leaves the
// database before tx commits. A message that is not an event envelope is
// refused before anything is written (ErrNotEnvelope). The tables must exist (Migrate). Close is a
// no-op. Config.PublisherDecorators wrap the result. The insert runs in
// tx's own exec mode (on pgx, the pool's): behind a transaction pooler
// that does not track prepared statements, a pool in pgx's default
// QueryExecModeCacheStatement fails it (26000, 42P05) as it fails the
// producer's own statements; the modes pgx advises there work (docs/databases.md).
func (o *Outbox) Publisher(tx wsql.ContextExecutor) (message.Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: Publisher: nil transaction")
	}
	var pub message.Publisher = &txPublisher{o: o, tx: tx}
	for _, d := range o.cfg.PublisherDecorators {
		var err error
		if pub, err = d(pub); err != nil {
			return nil, fmt.Errorf("outbox: publisher decorator: %w", err)
		}
	}
	return pub, nil
}

// PgxPublisher is Publisher on a pgx transaction.
func (o *Outbox) PgxPublisher(tx pgx.Tx) (message.Publisher, error) {
	return o.Publisher(wsql.TxFromPgx(tx))
}

// StdPublisher is Publisher on a database/sql transaction.
func (o *Outbox) StdPublisher(tx *sql.Tx) (message.Publisher, error) {
	return o.Publisher(wsql.TxFromStdSQL(tx))
}

// ErrEmptyTopic is returned by a Publisher's Publish for topic "".
var ErrEmptyTopic = errors.New("outbox: empty destination topic")

// ErrNotEnvelope is returned (wrapped, with the message's UUID and what is
// wrong) by a Publisher's Publish for a message that is not an event
// envelope the relay could ever publish (marshaler.ToEnvelope refuses it: no
// event name, a UUID that is not an event id, a payload that is not JSON):
// written anyway, it would fail at every relay round and end dead-lettered.
// Nothing of the call is written when it is returned for any message.
// Build messages with marshaler.NewMessage.
var ErrNotEnvelope = errors.New("outbox: message is not an event envelope")

type txPublisher struct {
	o  *Outbox
	tx wsql.ContextExecutor
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == "" {
		return ErrEmptyTopic
	}
	for _, m := range msgs {
		if m == nil {
			return errors.New("outbox: publish: nil message")
		}
		if err := marshaler.CheckEnvelope(m); err != nil {
			return fmt.Errorf("%w: %q: %w (build it with marshaler.NewMessage)", ErrNotEnvelope, m.UUID, err)
		}
	}
	for _, m := range msgs {
		// A message forwarded from the one received (msg.Copy()) goes
		// without the keys of that delivery (wire.DeliveryScoped).
		md, err := json.Marshal(wire.WithoutDelivery(m.Metadata))
		if err != nil {
			return fmt.Errorf("outbox: publish %s: metadata: %w", m.UUID, err)
		}
		payload := []byte(m.Payload)
		if payload == nil {
			payload = []byte{}
		}
		// The event id is stored in its canonical form (CheckEnvelope
		// accepted any RFC 9562 text form): an operator's
		// `idem outbox redrive --event-id` finds it whatever form the
		// producer wrote.
		id := m.UUID
		if eid, err := marshaler.ParseEventID(id); err == nil {
			id = eid.String()
		}
		if _, err := p.tx.ExecContext(m.Context(), p.o.q.at(p.o.q.insert), id, topic, payload, string(md)); err != nil {
			return fmt.Errorf("outbox: publish %s: %w", m.UUID, err)
		}
	}
	return nil
}

func (p *txPublisher) Close() error { return nil }

// Pending counts the outbox's pending rows (committed, not yet relayed nor
// dead-lettered). Rows of transactions still open are not visible.
func (o *Outbox) Pending(ctx context.Context) (int, error) {
	n, _, err := o.stats(ctx, o.beginner())
	return n, err
}

// DeadLetters counts the rows in the dead-letter table.
func (o *Outbox) DeadLetters(ctx context.Context) (int, error) {
	var n int
	if err := queryRow(ctx, o.beginner(), o.q.countDead, nil, &n); err != nil {
		return 0, fmt.Errorf("outbox: dead letters: %w", err)
	}
	return n, nil
}

// beginner is the outbox's DB as watermill-sql sees it; on pgx its
// statements are sent in the outbox's exec mode (sqldb.OwnMode).
func (o *Outbox) beginner() wsql.Beginner {
	if o.db.Pgx != nil {
		return wsql.BeginnerFromPgx(modePool{o.db.Pgx, o.mode})
	}
	return wsql.BeginnerFromStdSQL(o.db.Std)
}

// stats returns the pending rows and the age of the oldest (0 when none),
// both read by the database: the age is its clock minus the row's write
// time (its clock too), so no process clock is involved; ≥ 0 even if the
// database clock stepped back.
func (o *Outbox) stats(ctx context.Context, db wsql.ContextExecutor) (int, time.Duration, error) {
	var n int
	var ageUs sql.NullInt64
	if err := queryRow(ctx, db, o.q.at(o.q.stats), nil, &n, &ageUs); err != nil {
		return 0, 0, fmt.Errorf("outbox: pending: %w", err)
	}
	return n, time.Duration(max(ageUs.Int64, 0)) * time.Microsecond, nil
}

// queryRow runs a query expected to return one row and scans it.
func queryRow(ctx context.Context, db wsql.ContextExecutor, q string, args []any, dest ...any) error {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return err
	}
	if !rows.Next() {
		if err := closeRows(rows); err != nil {
			return err
		}
		return sql.ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		_ = rows.Close()
		return err
	}
	return closeRows(rows)
}

// closeRows closes rows and returns the error that ended them, if any.
// pgx reports a statement that failed on the server through its rows
// (Rows.Err), and watermill-sql's pgx adapter returns nil from Close:
// without Err a failed read would look like an empty result.
func closeRows(rows wsql.Rows) error {
	err := rows.Close()
	if r, ok := rows.(interface{ Err() error }); ok {
		if rerr := r.Err(); rerr != nil {
			return rerr
		}
	}
	return err
}

// tables are the quoted names of an outbox's tables.
type tables struct {
	Table, Dead, Archive, Lock, Prefix string
}

func tableNames(table string, d sqldb.Dialect) (tables, error) {
	var out tables
	for _, t := range []struct {
		dst    *string
		suffix string
	}{{&out.Table, ""}, {&out.Dead, "_dead"}, {&out.Archive, "_relayed"}, {&out.Lock, "_relay"}} {
		id, err := sqldb.ParseIdent(table + t.suffix)
		if err != nil {
			return tables{}, fmt.Errorf("outbox: Config.Table %q: %w", table, err)
		}
		*t.dst = id.Quoted(d.QuoteChar())
		if t.suffix == "" {
			out.Prefix = id.Name()
		}
	}
	return out, nil
}

// placeholders returns n placeholders of d starting at from (1-based), comma
// separated.
func placeholders(d sqldb.Dialect, from, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		if d == sqldb.PostgreSQL {
			fmt.Fprintf(&b, "$%d", from+i)
		} else {
			b.WriteByte('?')
		}
	}
	return b.String()
}
