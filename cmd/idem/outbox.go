package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	idemamqp "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// defaultEventsExchange is the shop's events exchange (examples/shop
// DefaultExchange): a durable topic exchange, routing key = event topic.
const defaultEventsExchange = "events"

// replayFilter selects the outbox events to republish: the shape of the
// outbox library's ReplayFilter (helper i12's outbox.ReplayFilter: From ≤
// t < To at microsecond precision, Topics, DryRun), so that replaying
// through it is an adapter of a few lines.
type replayFilter struct {
	From, To time.Time
	Topics   []string
	DryRun   bool
}

// outboxReplayer republishes outbox events through dest with their original
// event_id, payload and metadata, and returns how many it published (with
// DryRun: would publish). On error the events before it were published.
// The signature is the outbox library's (*outbox.Outbox).Replay(ctx, db,
// dest, filter) with db bound.
type outboxReplayer interface {
	Replay(ctx context.Context, dest message.Publisher, f replayFilter) (int, error)
}

// forwarderOutbox is the outboxReplayer of this branch's outbox package: a
// watermill-sql PostgreSQL messages table written through Watermill's
// forwarder publisher (outbox.Config.ForwarderTopic, table
// "watermill_<topic>"), whose rows stay after the relay sent them. It
// selects by the envelope's occurred_at (the producer's clock), as
// examples/shop.ReplayOutbox does, pending rows included (the relay sends
// those too: one more copy, skipped by the consumers' claim).
type forwarderOutbox struct {
	db    *sql.DB
	table string // quoted
}

// forwarderRow is the forwarder's envelope as stored (payload base64).
type forwarderRow struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

func (o forwarderOutbox) Replay(ctx context.Context, dest message.Publisher, f replayFilter) (int, error) {
	q := `SELECT payload::text FROM ` + o.table + `
WHERE (payload->'metadata'->>'` + marshaler.MetadataOccurredAt + `')::timestamptz >= $1
  AND (payload->'metadata'->>'` + marshaler.MetadataOccurredAt + `')::timestamptz < $2`
	args := []any{f.From, f.To}
	if len(f.Topics) > 0 {
		q += ` AND payload->>'destination_topic' = ANY($3)`
		args = append(args, f.Topics)
	}
	rows, err := o.db.QueryContext(ctx, q+` ORDER BY transaction_id, "offset"`, args...)
	if err != nil {
		return 0, err
	}
	var evs []forwarderRow
	for rows.Next() {
		var raw string
		if err := rows.Scan(&raw); err != nil {
			_ = rows.Close()
			return 0, err
		}
		var e forwarderRow
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			_ = rows.Close()
			return 0, fmt.Errorf("outbox row: %w", err)
		}
		evs = append(evs, e)
	}
	if err := rows.Close(); err != nil {
		return 0, err
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if f.DryRun {
		return len(evs), nil
	}
	for i, e := range evs {
		msg := message.NewMessage(e.UUID, e.Payload)
		for k, v := range e.Metadata {
			msg.Metadata.Set(k, v)
		}
		msg.SetContext(ctx)
		if err := dest.Publish(e.DestinationTopic, msg); err != nil {
			return i, fmt.Errorf("replay %s: %w", e.UUID, err)
		}
	}
	return len(evs), nil
}

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

func runOutboxReplay(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	from := fs.String("from", "", "start of the range, inclusive (RFC 3339)")
	to := fs.String("to", "", "end of the range, exclusive (RFC 3339)")
	var topics stringList
	fs.Var(&topics, "topic", "only events for this destination topic (repeatable)")
	dryRun := fs.Bool("dry-run", false, "count what would be republished; publish nothing")
	exchange := fs.String("exchange", defaultEventsExchange, "the events exchange (topic, durable); routing key = the event's topic")
	forwarderTopic := fs.String("forwarder-topic", outbox.DefaultForwarderTopic, "the outbox's watermill-sql topic (table \"watermill_<topic>\")")
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
	if !t1.Before(t2) {
		return usageErr("--from %s is not before --to %s", *from, *to)
	}
	if _, err := sqldb.ParseIdent("watermill_" + *forwarderTopic); err != nil {
		return usageErr("--forwarder-topic: %v", err)
	}
	d, err := e.dialect()
	if err != nil {
		return err
	}
	if d != sqldb.PostgreSQL {
		return usageErr("outbox replay: only PostgreSQL outboxes (watermill-sql's PostgreSQL schema) in this version")
	}
	db, _, err := e.openDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	table := `"watermill_` + *forwarderTopic + `"`
	var r outboxReplayer = forwarderOutbox{db: db, table: table}
	f := replayFilter{From: t1, To: t2, Topics: topics, DryRun: *dryRun}

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
		cfg := wamqp.Config{
			Connection: wamqp.ConnectionConfig{AmqpURI: e.amqpURL},
			Marshaler:  idemamqp.Marshaler{},
			Exchange: wamqp.ExchangeConfig{
				GenerateName: wamqp.GenerateExchangeNameConstant(*exchange),
				Type:         amqp091.ExchangeTopic,
				Durable:      true,
			},
			Publish: wamqp.PublishConfig{
				GenerateRoutingKey: func(topic string) string { return topic },
				ConfirmDelivery:    true,
			},
			TopologyBuilder: &wamqp.DefaultTopologyBuilder{},
		}
		p, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
		if err != nil {
			return failedErr("broker: publisher: %v", err)
		}
		defer p.Close()
		pub = p
	}
	n, err := r.Replay(ctx, pub, f)
	if err != nil {
		return dbErr(fmt.Sprintf("outbox replay (%d published before the error)", n), "watermill_"+*forwarderTopic, err)
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
	fmt.Fprintf(e.stdout, "outbox %s, [%s, %s), %s: %d event(s) %s with their original event ids\n", table, rep.From, rep.To, scope, n, verb)
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
