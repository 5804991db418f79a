package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
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
	// Our chain's poison path (middleware.NewConsumer):
	// the class (permanent or exhausted) and the reason's full length.
	headerPoisonClass = inbox.MetadataPoisonClass
	headerReasonBytes = inbox.MetadataReasonBytes
	// headerPoisonedAt is the failure time our chain stamps (RFC 3339);
	// Watermill's PoisonQueue stamps none.
	headerPoisonedAt = inbox.MetadataPoisonedAt
	// headerOriginQueue is the queue the message was consumed from, set by
	// the poison publishers of marshaler/amqp's DeadLetterConfig (from the
	// subscriber's queue name for topic_poisoned).
	headerOriginQueue = "idempotency_origin_queue"
)

// poisonHeader reports whether a header belongs to the failure, not to the
// message: a redriven copy goes without it.
func poisonHeader(k string) bool {
	switch k {
	case headerReason, headerTopic, headerHandler, headerSubscriber, headerPoisonedAt, headerPoisonClass, headerReasonBytes, headerOriginQueue,
		inbox.MetadataAttempt, inbox.MetadataPoisonCount, "x-death", "x-delivery-count",
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

// queueChecks asks the broker whether a queue exists, once per name.
type queueChecks struct {
	conn *amqp091.Connection
	seen map[string]error
}

func newQueueChecks(conn *amqp091.Connection) *queueChecks {
	return &queueChecks{conn: conn, seen: map[string]error{}}
}

// exists returns nil when queue exists, else queueDepth's error.
func (q *queueChecks) exists(queue string) error {
	if err, ok := q.seen[queue]; ok {
		return err
	}
	_, err := queueDepth(q.conn, queue)
	q.seen[queue] = err
	return err
}

// resolveOrigin sets dl.Origin, when no header names the origin queue, to
// topic_poisoned if a queue of that name exists: the topic is the queue in
// the queue layout (amqp.NewDurableQueueConfig) only; elsewhere it is a
// routing key or an exchange, and the origin stays unknown. It fails only
// when the broker does.
func (q *queueChecks) resolveOrigin(dl *deadLetter) error {
	if dl.Origin != "" || dl.Topic == "" {
		return nil
	}
	err := q.exists(dl.Topic)
	if err == nil {
		dl.Origin = dl.Topic
		return nil
	}
	if codeOf(err) == exitNotFound {
		return nil
	}
	return err
}

// originText is dl's origin as list and show print it: the queue, or "?"
// with topic_poisoned when that is not a queue.
func originText(dl deadLetter) string {
	if dl.Origin == "" && dl.Topic != "" {
		return fmt.Sprintf("? (topic %s)", dl.Topic)
	}
	return dash(dl.Origin)
}

// noOrigin says why dl has no origin queue, and what to pass instead.
func noOrigin(dl deadLetter) string {
	if dl.Topic == "" {
		return "no origin queue in its headers (use --to QUEUE)"
	}
	return fmt.Sprintf("origin unknown: topic_poisoned %q is no queue (a routing key or exchange); use --to QUEUE, the consumer's queue", dl.Topic)
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
	Origin       string            `json:"origin_queue"`    // where a redrive sends it by default; "" when unknown
	Topic        string            `json:"topic,omitempty"` // topic_poisoned: the Watermill topic it was consumed from
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
	deaths := xDeaths(d.Headers["x-death"])
	lastQueue, lastReason := lastDeath(d.Headers, deaths)
	dl.Reason, dl.Class = h(headerReason), h(headerPoisonClass)
	if dl.Reason == "" && lastReason != "" {
		dl.Reason, dl.Class = "broker dead-lettered: "+lastReason, lastReason
	}
	if dl.Reason == "" && dl.Malformed {
		dl.Reason = "malformed: " + err.Error()
	}
	if n, err := strconv.Atoi(h(inbox.MetadataAttempt)); err == nil {
		dl.Attempts = n
	}
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
	// The queue a header names; topic_poisoned only once checked
	// (queueChecks.resolveOrigin).
	dl.Origin = h(headerOriginQueue)
	if dl.Origin == "" {
		dl.Origin = lastQueue
	}
	dl.Topic = h(headerTopic)
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
	count  int
	time   time.Time
	queue  string
	reason string
}

// lastDeath is the queue RabbitMQ last dead-lettered the message from, and
// why: x-last-death-queue and x-last-death-reason (RabbitMQ 3.13 and
// later), else x-death's first entry (the latest death comes first), else
// x-first-death-queue and x-first-death-reason. A message dead-lettered
// more than once (expired from a delay queue into the consumer's queue,
// then rejected or over its delivery limit there) names its first queue in
// x-first-death-queue: not the one it came to the dead-letter queue from.
func lastDeath(headers amqp091.Table, deaths []death) (queue, reason string) {
	h := func(k string) string {
		v, ok := headers[k]
		if !ok {
			return ""
		}
		return headerString(v)
	}
	if q := h("x-last-death-queue"); q != "" {
		return q, h("x-last-death-reason")
	}
	if len(deaths) > 0 && deaths[0].queue != "" {
		return deaths[0].queue, deaths[0].reason
	}
	return h("x-first-death-queue"), h("x-first-death-reason")
}

// xDeaths reads RabbitMQ's x-death header: an array of tables with count
// (long), time (timestamp), queue and reason, one per (queue, reason), the
// latest death first.
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
		d.queue, _ = t["queue"].(string)
		d.reason, _ = t["reason"].(string)
		out = append(out, d)
	}
	return out
}

// browseChan is the browsing channel as f and flush see it: acks only,
// counted.
type browseChan struct {
	ch    *amqp091.Channel
	acked int
}

// Ack acks one delivery (multiple is not used by idem).
func (b *browseChan) Ack(tag uint64, multiple bool) error {
	if err := b.ch.Ack(tag, multiple); err != nil {
		return err
	}
	b.acked++
	return nil
}

// requeueWait bounds how long browse waits for its requeued messages to be
// ready again before it returns.
const requeueWait = 10 * time.Second

// browseIdle is how long browse waits for the next delivery before it asks
// the broker whether any message is still ready (another consumer may have
// taken some since the browse started).
const browseIdle = 5 * time.Second

// browse reads up to limit deliveries of queue (0: as many as it held when
// the browse started, so that messages arriving meanwhile cannot make it
// loop) with a consumer of its own (basic.consume, no auto-ack, prefetch
// limit: far faster than basic.get on a quorum queue), and calls f on each
// with the channel, on which f may ack the delivery (a redrive does, once
// the copy is confirmed). At the end every delivery not acked is requeued
// (basic.nack, multiple, requeue), and the channel's close would requeue
// them too if the process died first. Browsing does not consume, but it is
// visible: each browsed message comes back with redelivered=true, and on a
// quorum queue its x-delivery-count goes up by one (which counts against an
// x-delivery-limit set on the dead-letter queue itself); while browsed it
// is invisible to other consumers.
//
// flush, when not nil, runs after the last delivery and before the
// requeue, even when f failed: a redrive acks there what is confirmed.
func browse(ctx context.Context, conn *amqp091.Connection, queue string, limit int, f func(ch *browseChan, d amqp091.Delivery, pos int) error,
	flush func(ch *browseChan) error) (seen int, err error) {
	depth, err := queueDepth(conn, queue)
	if err != nil {
		return 0, err
	}
	if limit <= 0 || limit > depth {
		limit = depth
	}
	if limit == 0 {
		return 0, nil
	}
	ch, err := conn.Channel()
	if err != nil {
		return 0, failedErr("broker: open channel: %v", err)
	}
	defer ch.Close() // returns anything still unacked
	prefetch := limit
	if prefetch > 65535 { // basic.qos prefetch-count is a short
		prefetch = 0
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return 0, failedErr("broker: qos: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tag := fmt.Sprintf("idem-browse-%d-%d", os.Getpid(), time.Now().UnixNano())
	deliveries, err := ch.ConsumeWithContext(cctx, queue, tag, false, false, false, false, nil)
	if err != nil {
		return 0, failedErr("broker: consume from %q: %v", queue, err)
	}
	bc := &browseChan{ch: ch}
	defer func() {
		if flush != nil {
			if ferr := flush(bc); ferr != nil && err == nil {
				err = ferr
			}
		}
		// Cancel first: a live consumer would get the requeued messages
		// pushed straight back. Then tag 0 with multiple: every delivery
		// still unacked on ch, including those prefetched beyond limit.
		if cerr := ch.Cancel(tag, false); cerr != nil && err == nil {
			err = failedErr("broker: cancel browsing consumer: %v", cerr)
		}
		if nerr := ch.Nack(0, true, true); nerr != nil && err == nil {
			err = failedErr("broker: requeue browsed messages: %v", nerr)
		}
		_ = ch.Close()
		// A requeue is asynchronous (on a quorum queue it goes through
		// the queue's log): wait, within requeueWait, until the queue
		// holds again what it held minus what was acked, so that the next
		// command sees every message.
		if seen > bc.acked {
			waitReady(conn, queue, depth-bc.acked)
		}
	}()
	idle := time.NewTimer(browseIdle)
	defer idle.Stop()
	for seen < limit {
		select {
		case <-ctx.Done():
			return seen, ctx.Err()
		case d, ok := <-deliveries:
			if !ok {
				return seen, failedErr("broker: consumer on %q closed", queue)
			}
			seen++
			if err := f(bc, d, seen); err != nil {
				return seen, err
			}
			if !idle.Stop() {
				select {
				case <-idle.C:
				default:
				}
			}
			idle.Reset(browseIdle)
		case <-idle.C:
			// Nothing for a while: stop if nothing is ready any more.
			n, err := queueDepth(conn, queue)
			if err != nil {
				return seen, err
			}
			if n == 0 {
				return seen, nil
			}
			idle.Reset(browseIdle)
		}
	}
	return seen, nil
}

// waitReady polls queue until it has at least want ready messages, for at
// most requeueWait (messages taken meanwhile by another consumer would make
// it wait that long, and no more).
func waitReady(conn *amqp091.Connection, queue string, want int) {
	deadline := time.Now().Add(requeueWait)
	for time.Now().Before(deadline) {
		n, err := queueDepth(conn, queue)
		if err != nil || n >= want {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
