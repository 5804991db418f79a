package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/crashpoint"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// crashAfterPublish is the crash point between the confirmed publish of a
// redriven copy and the ack of its dead letter (kill tests).
const crashAfterPublish = "idem-redrive-after-publish"

// Defaults of the dlq commands.
const (
	defaultListLimit = 1000
	defaultProgress  = 500
	defaultWindow    = 128
	flushTimeout     = 30 * time.Second
	maxTableRows     = 50
)

// dlqList is the JSON document of "dlq list".
type dlqList struct {
	Queue    string       `json:"queue"`
	Depth    int          `json:"depth"` // ready messages when the browse started
	Listed   int          `json:"listed"`
	Messages []deadLetter `json:"messages"`
}

func runDLQList(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	limit := fs.Int("limit", defaultListLimit, "list at most N messages, from the head of the queue")
	pos, err := e.parse(fs, args, 1, 1)
	if err != nil {
		return err
	}
	if *limit <= 0 {
		return usageErr("--limit %d: must be > 0", *limit)
	}
	conn, err := e.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	queue := pos[0]
	depth, err := queueDepth(conn, queue)
	if err != nil {
		return err
	}
	out := dlqList{Queue: queue, Depth: depth, Messages: []deadLetter{}}
	queues := newQueueChecks(conn)
	if _, err := browse(ctx, conn, queue, *limit, func(_ *browseChan, d amqp091.Delivery, pos int) error {
		dl := describe(d, pos)
		if err := queues.resolveOrigin(&dl); err != nil {
			return err
		}
		out.Messages = append(out.Messages, dl)
		return nil
	}, nil); err != nil {
		return err
	}
	out.Listed = len(out.Messages)
	if e.json {
		return printJSON(e.stdout, out)
	}
	fmt.Fprintf(e.stdout, "queue %s: %d message(s), %d listed (browsed and requeued)\n\n", queue, depth, out.Listed)
	rows := make([][]string, 0, len(out.Messages))
	for _, m := range out.Messages {
		rows = append(rows, []string{strconv.Itoa(m.Position), dash(m.EventID), dash(m.EventName), attemptsText(m.Attempts),
			tsPtr(m.FirstFailure), tsPtr(m.LastFailure), originText(m), truncate(dash(m.Reason), 60)})
	}
	table(e.stdout, []string{"#", "EVENT_ID", "EVENT_NAME", "ATTEMPTS", "FIRST_FAILURE", "LAST_FAILURE", "ORIGIN", "REASON"}, rows)
	return nil
}

func attemptsText(n int) string {
	if n == 0 {
		return "-"
	}
	return strconv.Itoa(n)
}

func tsPtr(t *jsonTime) string {
	if t == nil {
		return "-"
	}
	return ts(time.Time(*t))
}

func runDLQShow(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	payload := fs.Bool("payload", false, "also print the payload (the envelope's payload JSON; the raw body of a malformed message)")
	pos, err := e.parse(fs, args, 2, 2)
	if err != nil {
		return err
	}
	id, err := marshaler.ParseEventID(pos[1])
	if err != nil {
		return usageErr("%q: %v", pos[1], err)
	}
	conn, err := e.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	queue := pos[0]
	var found []deadLetter
	queues := newQueueChecks(conn)
	if _, err := browse(ctx, conn, queue, 0, func(_ *browseChan, d amqp091.Delivery, pos int) error {
		dl := describe(d, pos)
		if dl.EventID != id.String() {
			return nil
		}
		if err := queues.resolveOrigin(&dl); err != nil {
			return err
		}
		dl.Headers = map[string]string{}
		for k, v := range d.Headers {
			dl.Headers[k] = headerString(v)
		}
		if *payload {
			if !dl.Malformed && json.Valid(dl.payload) {
				dl.Payload = json.RawMessage(dl.payload)
			} else {
				dl.RawBody = string(dl.payload)
			}
		}
		found = append(found, dl)
		return nil
	}, nil); err != nil {
		return err
	}
	if len(found) == 0 {
		return notFoundErr("no message with event id %s in queue %q", id, queue)
	}
	if e.json {
		return printJSON(e.stdout, map[string]any{"queue": queue, "event_id": id.String(), "messages": found})
	}
	for i, m := range found {
		if i > 0 {
			fmt.Fprintln(e.stdout)
		}
		kv := [][2]string{
			{"queue", queue}, {"position", strconv.Itoa(m.Position)}, {"event_id", m.EventID}, {"event_name", dash(m.EventName)},
			{"occurred_at", tsPtr(m.OccurredAt)}, {"reason", dash(oneLine(m.Reason))}, {"attempts", attemptsText(m.Attempts)},
			{"first_failure", tsPtr(m.FirstFailure)}, {"last_failure", tsPtr(m.LastFailure)},
			{"origin_queue", originText(m)}, {"handler", dash(m.Handler)}, {"malformed", strconv.FormatBool(m.Malformed)},
			{"bytes", strconv.Itoa(m.Bytes)},
		}
		keys := make([]string, 0, len(m.Headers))
		for k := range m.Headers {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			kv = append(kv, [2]string{"header " + k, truncate(m.Headers[k], 200)})
		}
		if *payload {
			if m.Payload != nil {
				kv = append(kv, [2]string{"payload", string(m.Payload)})
			} else {
				kv = append(kv, [2]string{"raw_body", strconv.Quote(m.RawBody)})
			}
		}
		fields(e.stdout, kv)
	}
	return nil
}

// eventIDs is a repeatable --event-id flag.
type eventIDs []string

func (l *eventIDs) String() string { return strings.Join(*l, ",") }
func (l *eventIDs) Set(s string) error {
	id, err := marshaler.ParseEventID(s)
	if err != nil {
		return fmt.Errorf("%q: %v", s, err)
	}
	*l = append(*l, id.String())
	return nil
}

// redriveItem is one message's outcome in "dlq redrive".
type redriveItem struct {
	EventID   string `json:"event_id"`
	EventName string `json:"event_name"`
	To        string `json:"to"`
	Result    string `json:"result"` // redriven, would redrive, left: <why>
}

// redriveReport is the JSON document of "dlq redrive".
type redriveReport struct {
	Queue    string        `json:"queue"`
	DryRun   bool          `json:"dry_run"`
	Browsed  int           `json:"browsed"`
	Redriven int           `json:"redriven"`
	Left     int           `json:"left"` // selected but not moved
	Items    []redriveItem `json:"items"`
}

func runDLQRedrive(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	var ids eventIDs
	fs.Var(&ids, "event-id", "redrive the message(s) with this event id (repeatable; any UUID text form)")
	all := fs.Bool("all", false, "redrive every message of the queue")
	dryRun := fs.Bool("dry-run", false, "only say what would be redriven and where; change nothing")
	to := fs.String("to", "", "target queue (default: each message's origin queue: idempotency_origin_queue, the queue RabbitMQ last dead-lettered it from (x-last-death-queue, x-death), or topic_poisoned if a queue has that name)")
	exchange := fs.String("exchange", "", "publish to this exchange with --to as routing key, instead of the default exchange (queue --to)")
	progress := fs.Int("progress", defaultProgress, "print progress on stderr every N messages moved (0: never)")
	window := fs.Int("window", defaultWindow, "copies in flight awaiting the broker's confirm before their dead letters are acked")
	pos, err := e.parse(fs, args, 1, 1)
	if err != nil {
		return err
	}
	switch {
	case *all == (len(ids) > 0):
		return usageErr("give --event-id ID (repeatable) or --all, one of them")
	case *exchange != "" && *to == "":
		return usageErr("--exchange needs --to (the routing key)")
	case *window <= 0:
		return usageErr("--window %d: must be > 0", *window)
	case *progress < 0:
		return usageErr("--progress %d: must be ≥ 0", *progress)
	}
	queue := pos[0]
	if *to == queue && *exchange == "" {
		return usageErr("--to %q is the dead-letter queue itself", queue)
	}
	conn, err := e.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := queueDepth(conn, queue); err != nil {
		return err
	}
	if *to != "" && *exchange == "" {
		if _, err := queueDepth(conn, *to); err != nil {
			return err
		}
	}
	if *exchange != "" {
		// A typo moves nothing: the broker would close the channel on
		// the first publish to a missing exchange.
		if err := exchangeExists(conn, *exchange); err != nil {
			return err
		}
	}
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	// With --event-id, check first that every id is there: a typo changes
	// nothing.
	if len(want) > 0 {
		present := map[string]bool{}
		if _, err := browse(ctx, conn, queue, 0, func(_ *browseChan, d amqp091.Delivery, _ int) error {
			present[describe(d, 0).EventID] = true
			return nil
		}, nil); err != nil {
			return err
		}
		var missing []string
		for _, id := range ids {
			if !present[id] {
				missing = append(missing, id)
			}
		}
		if len(missing) > 0 {
			return notFoundErr("not in queue %q: %s (nothing redriven)", queue, strings.Join(missing, ", "))
		}
	}

	r := &redriver{e: e, conn: conn, exchange: *exchange, queues: newQueueChecks(conn), window: *window}
	if !*dryRun {
		if err := r.open(); err != nil {
			return err
		}
		defer r.pch.Close()
	}
	rep := redriveReport{Queue: queue, DryRun: *dryRun, Items: []redriveItem{}}
	unknown := 0 // of rep.Left: origin queue unknown or missing
	start := time.Now()
	// Each selected dead letter is published (mandatory, confirmed) and
	// acked only once the broker confirmed its copy; up to --window copies
	// are in flight at once. A crash anywhere leaves every dead letter
	// whose copy is not confirmed in the queue (unacked deliveries return
	// when the connection dies): a second run moves them, and a copy that
	// made it twice is skipped by the consumer's claim.
	flush := func(ch *browseChan) error {
		// Detached from ctx (bounded), so that after an interrupt the
		// copies already confirmed still get their dead letters acked.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), flushTimeout)
		defer cancel()
		return r.flush(fctx, ch, func(p pendingCopy, err error) {
			it := &rep.Items[p.item]
			if err != nil {
				it.Result = "left: " + err.Error()
				rep.Left++
				return
			}
			it.Result = "redriven"
			rep.Redriven++
			if *progress > 0 && rep.Redriven%*progress == 0 {
				fmt.Fprintf(e.stderr, "idem: redrive %s: %d moved (%.0f/s)\n", queue, rep.Redriven, float64(rep.Redriven)/time.Since(start).Seconds())
			}
		})
	}
	seen, err := browse(ctx, conn, queue, 0, func(ch *browseChan, d amqp091.Delivery, _ int) error {
		dl := describe(d, 0)
		if !*all && !want[dl.EventID] {
			return nil
		}
		item := redriveItem{EventID: dl.EventID, EventName: dl.EventName, To: *to}
		var err error
		if item.To == "" {
			err = r.queues.resolveOrigin(&dl)
			item.To = dl.Origin
		}
		rep.Items = append(rep.Items, item)
		it := &rep.Items[len(rep.Items)-1]
		switch {
		case d.Headers[inbox.MetadataPayloadOmitted] != nil:
			// A record of a failure whose copy the poison topic refused:
			// its payload is not here, so there is nothing to deliver.
			it.Result = "left: dead-lettered without its payload (" + inbox.MetadataPayloadOmitted + "): nothing to redrive"
			rep.Left++
			return nil
		case err != nil:
			it.Result = "left: " + err.Error()
			rep.Left++
			return nil
		case item.To == "":
			it.Result = "left: " + noOrigin(dl)
			rep.Left++
			unknown++
			return nil
		}
		if *exchange == "" {
			if err := r.queues.exists(item.To); err != nil {
				it.Result = "left: " + err.Error()
				rep.Left++
				if codeOf(err) == exitNotFound {
					unknown++
				}
				return nil
			}
		}
		if *dryRun {
			it.Result = "would redrive"
			return nil
		}
		if err := r.publish(ctx, item.To, d, len(rep.Items)-1); err != nil {
			it.Result = "left: " + err.Error()
			rep.Left++
			return err
		}
		if len(r.pending) >= r.window {
			return flush(ch)
		}
		return nil
	}, func(ch *browseChan) error {
		if *dryRun {
			return nil
		}
		return flush(ch)
	})
	rep.Browsed = seen
	if perr := e.printRedrive(rep); perr != nil && err == nil {
		err = perr
	}
	if err != nil {
		return fmt.Errorf("redrive stopped after %d moved: %w", rep.Redriven, err)
	}
	if rep.Left > 0 && rep.Left == unknown {
		return notFoundErr("%d selected message(s) left in %q: origin queue unknown or missing (see the result column; use --to QUEUE)", rep.Left, queue)
	}
	if rep.Left > 0 {
		return failedErr("%d selected message(s) left in %q (see the result column)", rep.Left, queue)
	}
	return nil
}

func (e *env) printRedrive(rep redriveReport) error {
	if e.json {
		return printJSON(e.stdout, rep)
	}
	verb := "redriven"
	if rep.DryRun {
		verb = "would be redriven (dry run)"
	}
	n := rep.Redriven
	if rep.DryRun {
		n = len(rep.Items) - rep.Left
	}
	fmt.Fprintf(e.stdout, "queue %s: %d browsed, %d %s, %d left\n", rep.Queue, rep.Browsed, n, verb, rep.Left)
	if len(rep.Items) == 0 {
		return nil
	}
	fmt.Fprintln(e.stdout)
	var rows [][]string
	for i, it := range rep.Items {
		if i == maxTableRows {
			rows = append(rows, []string{fmt.Sprintf("… %d more (use --json)", len(rep.Items)-maxTableRows), "", "", ""})
			break
		}
		rows = append(rows, []string{dash(it.EventID), dash(it.EventName), dash(it.To), it.Result})
	}
	table(e.stdout, []string{"EVENT_ID", "EVENT_NAME", "TO", "RESULT"}, rows)
	return nil
}

// redriver publishes copies with publisher confirms on a channel of its own.
type redriver struct {
	e        *env
	conn     *amqp091.Connection
	exchange string
	window   int
	pch      *amqp091.Channel
	returns  chan amqp091.Return
	returned map[string]int // MessageId → returns not yet matched
	queues   *queueChecks
	pending  []pendingCopy
}

// pendingCopy is a published copy awaiting its confirm.
type pendingCopy struct {
	d     amqp091.Delivery
	dc    *amqp091.DeferredConfirmation
	to    string
	item  int
	msgID string
}

func (r *redriver) open() error {
	ch, err := r.conn.Channel()
	if err != nil {
		return failedErr("broker: open channel: %v", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return failedErr("broker: confirm mode: %v", err)
	}
	r.pch = ch
	// Large enough for every copy of a window: the client library's reader
	// blocks on a full notification channel.
	r.returns = ch.NotifyReturn(make(chan amqp091.Return, 2*r.window+1))
	r.returned = map[string]int{}
	return nil
}

// publish sends a copy of d: the body byte for byte, the properties, and the
// headers without the poison ones; mandatory, so that an unroutable copy
// comes back instead of vanishing. Its confirm is awaited in flush.
func (r *redriver) publish(ctx context.Context, to string, d amqp091.Delivery, item int) error {
	headers := amqp091.Table{}
	for k, v := range d.Headers {
		if !poisonHeader(k) {
			headers[k] = v
		}
	}
	mode := d.DeliveryMode
	if mode == 0 {
		mode = amqp091.Persistent
	}
	pub := amqp091.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: mode, Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId,
		Body: d.Body,
	}
	dc, err := r.pch.PublishWithDeferredConfirmWithContext(ctx, r.exchange, to, true, false, pub)
	if err != nil {
		return failedErr("broker: publish to %q: %v", to, err)
	}
	r.pending = append(r.pending, pendingCopy{d: d, dc: dc, to: to, item: item, msgID: d.MessageId})
	return nil
}

// flush waits for the confirm of every pending copy, in order, and then
// acks on ch (the browsing channel) the dead letter of each confirmed copy
// that no return names; done reports each outcome. A basic.return is
// dispatched before the confirm of its publish, so once every confirm of
// the window is in, so is every return of the window's copies. Returns
// carry no delivery tag: they are matched by MessageId, which several
// copies may share (the same event dead-lettered twice; foreign messages
// without one). Every confirmed copy whose MessageId a return names is
// left, routed or not: its dead letter stays in the queue, a later run
// moves it again and the claim absorbs the duplicate. Acking the first
// such copy confirmed instead lost the message when the returned one was
// another (the return of a copy answered at once arrives before the
// confirm of one written to a queue).
func (r *redriver) flush(ctx context.Context, ch *browseChan, done func(pendingCopy, error)) error {
	pending := r.pending
	r.pending = nil
	var first error
	confirmed := 0
	for _, p := range pending {
		ok, err := p.dc.WaitContext(ctx)
		if err != nil {
			first = failedErr("broker: confirm of publish to %q: %v", p.to, err)
			break
		}
		if !ok {
			first = failedErr("broker: publish to %q nacked", p.to)
			break
		}
		confirmed++
	}
	r.drainReturns()
	returned := r.returned
	r.returned = map[string]int{}
	for i, p := range pending {
		if i >= confirmed {
			done(p, first)
			continue
		}
		if returned[p.msgID] > 0 {
			done(p, failedErr("broker: copy to %q returned unroutable (or a copy with the same MessageId %q was)", p.to, p.msgID))
			continue
		}
		crashpoint.Reached(crashAfterPublish)
		if err := ch.Ack(p.d.DeliveryTag, false); err != nil {
			// The copy is on the target queue; the dead letter comes back
			// when the channel closes: a second run redrives it again and
			// the consumer's claim skips the duplicate.
			aerr := failedErr("broker: ack: %v", err)
			for _, q := range pending[i:] {
				done(q, aerr)
			}
			return aerr
		}
		done(p, nil)
	}
	return first
}

func (r *redriver) drainReturns() {
	for {
		select {
		case ret, ok := <-r.returns:
			if !ok {
				// The channel closed (the broker refused a publish, or
				// went away): no more returns come, and the copies not
				// confirmed are not acked.
				return
			}
			r.returned[ret.MessageId]++
		default:
			return
		}
	}
}
