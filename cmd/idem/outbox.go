package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// defaultEventsExchange is the shop's events exchange (examples/shop
// DefaultExchange): a durable topic exchange, routing key = event topic.
const defaultEventsExchange = "events"

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }
func (l *stringList) Set(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	*l = append(*l, s)
	return nil
}

// parseTime accepts RFC 3339 (any offset, fraction optional).
func parseTime(flagName, s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, usageErr("--%s is required (RFC 3339, e.g. 2026-12-01T10:00:00Z)", flagName)
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, usageErr("--%s %q: not an RFC 3339 time (e.g. 2026-12-01T10:00:00Z)", flagName, s)
	}
	return t, nil
}

// replayReport is the JSON document of "outbox replay".
type replayReport struct {
	From      string   `json:"from"`
	To        string   `json:"to"`
	Topics    []string `json:"topics,omitempty"`
	Exchange  string   `json:"exchange"`
	DryRun    bool     `json:"dry_run"`
	Published int      `json:"published"` // dry run: would publish
}

// runOutboxReplay republishes relayed outbox rows through the outbox
// library's Replay (outbox.(*Outbox).Replay): the rows the relay kept in the
// archive table (<table>_relayed, RelayConfig.Retention > 0) whose write
// time is in [--from, --to), each with its original event_id, payload and
// metadata, in outbox order. Pending rows are not replayed (the relay sends
// them); rows older than the retention are gone.
func runOutboxReplay(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	from := fs.String("from", "", "start of the range of write times, inclusive (RFC 3339)")
	to := fs.String("to", "", "end of the range, exclusive (RFC 3339)")
	var topics stringList
	fs.Var(&topics, "topic", "only events for this destination topic (repeatable)")
	dryRun := fs.Bool("dry-run", false, "count what would be republished; publish nothing")
	exchange := fs.String("exchange", defaultEventsExchange, "the events exchange (topic, durable); routing key = the event's topic")
	table := fs.String("outbox-table", outbox.DefaultTable, "the outbox table (its archive is <table>_relayed)")
	if _, err := e.parse(fs, args, 0, 0); err != nil {
		return err
	}
	t1, err := parseTime("from", *from)
	if err != nil {
		return err
	}
	t2, err := parseTime("to", *to)
	if err != nil {
		return err
	}
	f := outbox.ReplayFilter{From: t1, To: t2, Topics: topics, DryRun: *dryRun}
	if err := f.Validate(); err != nil {
		return usageErr("--from %s is not before --to %s", *from, *to)
	}
	d, err := e.dialect()
	if err != nil {
		return err
	}
	db, _, err := e.openDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	ob, err := outbox.New(outbox.Config{Table: *table, DB: idempotency.SQL(db, d)}, nil)
	if err != nil {
		return usageErr("--outbox-table: %v", err)
	}

	var pub message.Publisher
	if !*dryRun {
		conn, err := e.dial()
		if err != nil {
			return err
		}
		err = exchangeExists(conn, *exchange)
		_ = conn.Close()
		if err != nil {
			return err
		}
		// Confirmed and mandatory: a copy no queue takes comes back
		// unroutable (idemamqp.ErrUnroutable) and stops the replay,
		// instead of being counted republished while the broker dropped
		// it.
		p, err := idemamqp.NewConfirmedPublisher(idemamqp.ConfirmedPublisherConfig{URL: e.amqpURL, Exchange: *exchange}, watermill.NopLogger{})
		if err != nil {
			return failedErr("broker: publisher: %v", err)
		}
		defer p.Close()
		pub = p
	}
	n, err := ob.Replay(ctx, wsql.BeginnerFromStdSQL(db), pub, f)
	if errors.Is(err, idemamqp.ErrUnroutable) {
		return notFoundErr("outbox replay: exchange %q routes a copy to no queue (%d republished before it, the rest not): %v", *exchange, n, err)
	}
	if err != nil {
		return dbErr(fmt.Sprintf("outbox replay (%d published before the error)", n), *table+"_relayed", err)
	}
	rep := replayReport{From: t1.Format(time.RFC3339Nano), To: t2.Format(time.RFC3339Nano), Topics: topics, Exchange: *exchange, DryRun: *dryRun, Published: n}
	if e.json {
		return printJSON(e.stdout, rep)
	}
	verb := "republished to exchange " + *exchange
	if *dryRun {
		verb = "would be republished (dry run)"
	}
	scope := "all topics"
	if len(topics) > 0 {
		scope = "topics " + strings.Join(topics, ", ")
	}
	fmt.Fprintf(e.stdout, "outbox %s, relayed rows written in [%s, %s), %s: %d event(s) %s with their original event ids\n",
		*table, rep.From, rep.To, scope, n, verb)
	return nil
}

// exchangeExists checks the exchange with a passive declare (on a channel
// of its own: a 404 closes it).
func exchangeExists(conn *amqp091.Connection, name string) error {
	ch, err := conn.Channel()
	if err != nil {
		return failedErr("broker: open channel: %v", err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclarePassive(name, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		var ae *amqp091.Error
		if errors.As(err, &ae) && ae.Code == amqp091.NotFound {
			return notFoundErr("exchange %q does not exist", name)
		}
		return failedErr("broker: exchange %q: %v", name, err)
	}
	return nil
}

// outboxRedriveReport is the JSON document of "outbox redrive".
type outboxRedriveReport struct {
	EventIDs []string `json:"event_ids,omitempty"`
	Topics   []string `json:"topics,omitempty"`
	All      bool     `json:"all"`
	DryRun   bool     `json:"dry_run"`
	Moved    int      `json:"moved"` // dry run: would move
}

// runOutboxRedrive moves dead-lettered outbox rows (<table>_dead) back to
// pending through the outbox library's Redrive: attempts reset, due at
// once, event ids kept; the running relay publishes them. Selected by
// event id and/or topic, or --all.
func runOutboxRedrive(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	var ids, topics stringList
	fs.Var(&ids, "event-id", "a dead-lettered row's event id (repeatable)")
	fs.Var(&topics, "topic", "only rows for this destination topic (repeatable)")
	all := fs.Bool("all", false, "every dead-lettered row")
	dryRun := fs.Bool("dry-run", false, "count what would be moved; move nothing")
	table := fs.String("outbox-table", outbox.DefaultTable, "the outbox table (its dead letters are <table>_dead)")
	if _, err := e.parse(fs, args, 0, 0); err != nil {
		return err
	}
	if *all && (len(ids) > 0 || len(topics) > 0) {
		return usageErr("--all selects every row: no --event-id or --topic with it")
	}
	// Ids in any UUID text form, matched in the canonical one the outbox
	// stores.
	for i, id := range ids {
		u, err := uuid.Parse(id)
		if err != nil {
			return usageErr("--event-id %q: not a UUID", id)
		}
		ids[i] = u.String()
	}
	f := outbox.RedriveFilter{EventIDs: ids, Topics: topics, All: *all, DryRun: *dryRun}
	if err := f.Validate(); err != nil {
		return usageErr("give --event-id, --topic or --all")
	}
	d, err := e.dialect()
	if err != nil {
		return err
	}
	db, _, err := e.openDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	ob, err := outbox.New(outbox.Config{Table: *table, DB: idempotency.SQL(db, d)}, nil)
	if err != nil {
		return usageErr("--outbox-table: %v", err)
	}
	// With --event-id, check first that every id is dead-lettered (under
	// the --topic filter): a typo changes nothing, as for dlq redrive.
	var missing []string
	for _, id := range ids {
		n, err := ob.Redrive(ctx, outbox.RedriveFilter{EventIDs: []string{id}, Topics: topics, DryRun: true})
		if err != nil {
			return dbErr("outbox redrive", *table+"_dead", err)
		}
		if n == 0 {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return notFoundErr("not dead-lettered in %s_dead: %s (nothing moved)", *table, strings.Join(missing, ", "))
	}
	n, err := ob.Redrive(ctx, f)
	if err != nil {
		return dbErr("outbox redrive", *table+"_dead", err)
	}
	if e.json {
		return printJSON(e.stdout, outboxRedriveReport{EventIDs: ids, Topics: topics, All: *all, DryRun: *dryRun, Moved: n})
	}
	verb := "moved back to pending (the relay publishes them)"
	if *dryRun {
		verb = "would be moved back to pending (dry run)"
	}
	fmt.Fprintf(e.stdout, "outbox %s: %d dead-lettered row(s) %s\n", *table, n, verb)
	return nil
}
