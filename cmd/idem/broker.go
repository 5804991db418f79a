package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
)

// Header names read from dead-lettered messages. Watermill's PoisonQueue
// (message/router/middleware/poison.go, v1.5.1) sets the four *_poisoned
// keys; our middleware counts attempts in middleware.MetadataAttempt; the
// marshaler flags undecodable deliveries (marshaler.MetadataMalformed*);
// RabbitMQ's own dead-lettering sets x-death and x-first-death-* /
// x-last-death-* (https://www.rabbitmq.com/docs/dlx).
const (
	headerReason     = "reason_poisoned"
	headerTopic      = "topic_poisoned"
	headerHandler    = "handler_poisoned"
	headerSubscriber = "subscriber_poisoned"
	// Our chain's poison path (helper i11b's work, names as planned there):
	// the class (permanent or exhausted) and the reason's full length.
	headerPoisonClass = "idempotency_poison_class"
	headerReasonBytes = "idempotency_reason_bytes"
	// headerPoisonedAt is read as the failure time when a poison path
	// stamps one (RFC 3339); Watermill's PoisonQueue does not.
	headerPoisonedAt = "idempotency_poisoned_at"
)

// poisonHeader reports whether a header belongs to the failure, not to the
// message: a redriven copy goes without it.
func poisonHeader(k string) bool {
	switch k {
	case headerReason, headerTopic, headerHandler, headerSubscriber, headerPoisonedAt, headerPoisonClass, headerReasonBytes,
		middleware.MetadataAttempt, "x-death", "x-delivery-count",
		marshaler.MetadataRedelivered, marshaler.MetadataDeliveryCount:
		return true
	}
	return strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")
}

// dial connects to the broker, one line on failure.
func (e *env) dial() (*amqp091.Connection, error) {
	conn, err := amqp091.DialConfig(e.amqpURL, amqp091.Config{Dial: amqp091.DefaultDial(connectTimeout), Properties: amqp091.Table{"connection_name": "idem"}})
	if err != nil {
		return nil, failedErr("broker %s unreachable: %v", redact(e.amqpURL), err)
	}
	return conn, nil
}

// queueDepth checks that queue exists (a passive declare, on a channel of
// its own: a 404 closes the channel) and returns its ready messages.
func queueDepth(conn *amqp091.Connection, queue string) (int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, failedErr("broker: open channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		var ae *amqp091.Error
		if errors.As(err, &ae) && ae.Code == amqp091.NotFound {
			return 0, notFoundErr("queue %q does not exist", queue)
		}
		return 0, failedErr("broker: queue %q: %v", queue, err)
	}
	return q.Messages, nil
}

// deadLetter is what idem tells about one dead-lettered delivery.
type deadLetter struct {
	Position     int               `json:"position"` // 1 = head of the queue when browsed
	EventID      string            `json:"event_id"` // "" when the body has none
	EventName    string            `json:"event_name"`
	OccurredAt   *jsonTime         `json:"occurred_at,omitempty"`
	Reason       string            `json:"reason"`
	Class        string            `json:"class,omitempty"` // permanent, exhausted (our chain), or the broker's reason
	Malformed    bool              `json:"malformed"`
	Attempts     int               `json:"attempts"` // 0: unknown
	FirstFailure *jsonTime         `json:"first_failure,omitempty"`
	LastFailure  *jsonTime         `json:"last_failure,omitempty"`
	Origin       string            `json:"origin_queue"` // where a redrive sends it by default
	Handler      string            `json:"handler,omitempty"`
	Redelivered  bool              `json:"redelivered"`
	Bytes        int               `json:"bytes"`
	Headers      map[string]string `json:"headers,omitempty"`  // show only
	Payload      json.RawMessage   `json:"payload,omitempty"`  // show --payload only
	RawBody      string            `json:"raw_body,omitempty"` // show --payload, malformed only

	payload []byte
}

// describe reads a dead-lettered delivery without changing it.
func describe(d amqp091.Delivery, pos int) deadLetter {
	dl := deadLetter{Position: pos, Redelivered: d.Redelivered, Bytes: len(d.Body)}
	h := func(k string) string {
		v, ok := d.Headers[k]
		if !ok {
			return ""
		}
		return headerString(v)
	}
	env, err := marshaler.Decode(d.Body, 1<<30)
	if err == nil {
		dl.EventID, dl.EventName = env.EventID.String(), env.EventName
		if !env.OccurredAt.IsZero() {
			t := jsonTime(env.OccurredAt)
			dl.OccurredAt = &t
		}
		dl.payload = env.Payload
	} else {
		dl.Malformed = true
		if id, perr := marshaler.ParseEventID(d.MessageId); perr == nil {
			dl.EventID = id.String()
		}
		dl.payload = d.Body
	}
	dl.Reason, dl.Class = h(headerReason), h(headerPoisonClass)
	if dl.Reason == "" {
		if r := h("x-first-death-reason"); r != "" {
			dl.Reason, dl.Class = "broker dead-lettered: "+r, r
		}
	}
	if dl.Reason == "" && dl.Malformed {
		dl.Reason = "malformed: " + err.Error()
	}
	if n, err := strconv.Atoi(h(middleware.MetadataAttempt)); err == nil {
		dl.Attempts = n
	}
	deaths := xDeaths(d.Headers["x-death"])
	var deathCount int
	for _, x := range deaths {
		deathCount += x.count
		if !x.time.IsZero() {
			t := jsonTime(x.time)
			if dl.FirstFailure == nil || x.time.Before(time.Time(*dl.FirstFailure)) {
				dl.FirstFailure = &t
			}
			if dl.LastFailure == nil || x.time.After(time.Time(*dl.LastFailure)) {
				t2 := t
				dl.LastFailure = &t2
			}
		}
	}
	if dl.Attempts == 0 {
		if n, err := strconv.Atoi(h("x-delivery-count")); err == nil {
			dl.Attempts = n + 1
		} else if deathCount > 0 {
			dl.Attempts = deathCount
		}
	}
	if at, err := time.Parse(time.RFC3339Nano, h(headerPoisonedAt)); err == nil {
		t := jsonTime(at)
		dl.LastFailure = &t
		if dl.FirstFailure == nil {
			dl.FirstFailure = &t
		}
	}
	dl.Origin = h("x-first-death-queue")
	if dl.Origin == "" {
		dl.Origin = h(headerTopic)
	}
	dl.Handler = h(headerHandler)
	return dl
}

// headerString renders one AMQP header value as text.
func headerString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case nil:
		return ""
	case []any, amqp091.Table:
		b, err := json.Marshal(v)
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	}
	return fmt.Sprint(v)
}

type death struct {
	count int
	time  time.Time
}

// xDeaths reads RabbitMQ's x-death header: an array of tables with count
// (long) and time (timestamp), one per (queue, reason).
func xDeaths(v any) []death {
	arr, ok := v.([]any)
	if !ok {
		return nil
	}
	var out []death
	for _, e := range arr {
		t, ok := e.(amqp091.Table)
		if !ok {
			continue
		}
		var d death
		switch c := t["count"].(type) {
		case int64:
			d.count = int(c)
		case int32:
			d.count = int(c)
		}
		if ts, ok := t["time"].(time.Time); ok {
			d.time = ts
		}
		out = append(out, d)
	}
	return out
}

// browse reads up to limit deliveries of queue (0: as many as it held when
// the browse started, so that messages arriving meanwhile cannot make it
// loop) with basic.get and no ack, and calls f on each with the channel,
// on which f may ack the delivery (a redrive does, once the copy is
// confirmed). At the end every delivery not acked is requeued (basic.nack,
// multiple, requeue), and the channel's close would requeue them too if the
// process died first. Browsing does not consume, but it is visible: each
// browsed message comes back with redelivered=true, and on a quorum queue
// its x-delivery-count goes up by one (which counts against an
// x-delivery-limit set on the dead-letter queue itself), and while browsed
// it is invisible to other consumers.
func browse(ctx context.Context, conn *amqp091.Connection, queue string, limit int, f func(ch *amqp091.Channel, d amqp091.Delivery, pos int) error) (seen int, err error) {
	depth, err := queueDepth(conn, queue)
	if err != nil {
		return 0, err
	}
	if limit <= 0 || limit > depth {
		limit = depth
	}
	ch, err := conn.Channel()
	if err != nil {
		return 0, failedErr("broker: open channel: %v", err)
	}
	defer ch.Close() // returns anything still unacked
	defer func() {
		// Tag 0 with multiple: every delivery still unacked on ch.
		if nerr := ch.Nack(0, true, true); nerr != nil && err == nil {
			err = failedErr("broker: requeue browsed messages: %v", nerr)
		}
	}()
	for seen < limit {
		if err := ctx.Err(); err != nil {
			return seen, err
		}
		d, ok, gerr := ch.Get(queue, false)
		if gerr != nil {
			return seen, failedErr("broker: get from %q: %v", queue, gerr)
		}
		if !ok {
			break
		}
		seen++
		if err := f(ch, d, seen); err != nil {
			return seen, err
		}
	}
	return seen, nil
}
