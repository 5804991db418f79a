package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
)

const vOursDup30 = "idempotent_dup30" // our middleware, 30 % of the messages already processed

type e2eCell struct {
	consumers, prefetch int
	variant             string
}

// e2eBroker is the transport of an end-to-end run: RabbitMQ or NATS
// JetStream. Each run gets a destination of its own (a queue, a stream),
// filled before the run and deleted after it.
type e2eBroker interface {
	// name is the transport's name in the tables.
	name() string
	// fill puts msgs on a new destination and returns its name once the
	// broker holds them all (persistent messages, durable storage).
	fill(ctx context.Context, msgs []*message.Message) (string, error)
	// subscriber returns a subscriber of dest for cell c and the topic the
	// router's c.consumers handlers subscribe to; each handler is one
	// subscription that takes a message at a time, at most c.prefetch
	// unacked per handler.
	subscriber(dest string, c e2eCell) (message.Subscriber, string, error)
	// drop deletes dest (errors are ignored: env.close retries).
	drop(dest string)
}

// e2eRig is one schema, pool and store for the end-to-end runs.
type e2eRig struct {
	e      *env
	pool   *pgxpool.Pool
	store  *processedstore.Store
	vs     *variantSet
	broker e2eBroker
}

func newE2ERig(ctx context.Context, e *env, prefix string, maxConsumers int) (*e2eRig, error) {
	schema, err := e.schema(ctx, prefix)
	if err != nil {
		return nil, err
	}
	pool, err := e.pool(ctx, schema, maxConsumers+1)
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, handlerSchema+floorUUIDSchema); err != nil {
		return nil, err
	}
	store, err := e.store(ctx, pool, schema, "processed_event")
	if err != nil {
		return nil, err
	}
	vs, err := newVariantSet(pool, store)
	if err != nil {
		return nil, err
	}
	return &e2eRig{e: e, pool: pool, store: store, vs: vs, broker: rabbitBroker{e}}, nil
}

// prefill publishes n events (persistent, through our marshaler) to a new
// destination of the rig's broker, a share dupShare of them with ids already
// processed, and returns it once the broker holds them all.
func (r *e2eRig) prefill(ctx context.Context, n int, dupShare float64) (string, error) {
	nDup := int(float64(n) * dupShare)
	var dups []uuid.UUID
	var err error
	if nDup > 0 {
		if dups, err = preclaim(ctx, r.pool, r.store, nDup); err != nil {
			return "", err
		}
	}
	isDup := make([]bool, n)
	for i := 0; i < nDup; i++ {
		isDup[i] = true
	}
	rand.Shuffle(n, func(i, j int) { isDup[i], isDup[j] = isDup[j], isDup[i] })
	msgs := make([]*message.Message, n)
	for i := range msgs {
		if isDup[i] {
			msgs[i], err = marshaler.NewMessageWithID(dups[0], eventName, time.Now().UTC(), payload())
			dups = dups[1:]
		} else {
			msgs[i], err = newV7()
		}
		if err != nil {
			return "", err
		}
	}
	return r.broker.fill(ctx, msgs)
}

// consume runs a Watermill router on dest (c.consumers handlers, each its
// own subscription with the prefetch) with the variant's chain, until n
// messages went through the chain; it returns the rate between the first
// message's arrival and the n-th's return. progress, if set, is called with
// the count after each message (memory sampling).
func (r *e2eRig) consume(ctx context.Context, dest string, c e2eCell, n int, progress func(int64)) (float64, error) {
	sub, topic, err := r.broker.subscriber(dest, c)
	if err != nil {
		return 0, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return 0, err
	}
	var (
		count      atomic.Int64
		firstStart atomic.Int64
		lastEnd    atomic.Int64
		failed     atomic.Pointer[error]
		done       = make(chan struct{})
	)
	counter := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			firstStart.CompareAndSwap(0, time.Now().UnixNano())
			out, err := h(msg)
			if err != nil {
				failed.CompareAndSwap(nil, &err)
				return out, err
			}
			k := count.Add(1)
			if progress != nil {
				progress(k)
			}
			if k == int64(n) {
				lastEnd.Store(time.Now().UnixNano())
				close(done)
			}
			return out, nil
		}
	}
	router.AddMiddleware(counter)
	variant := c.variant
	if variant == vOursDup30 {
		variant = vOurs
	}
	h := r.vs.handlerFor(variant, handler(h1))
	for i := 0; i < c.consumers; i++ {
		router.AddConsumerHandler("bench_"+strconv.Itoa(i), topic, sub, func(msg *message.Message) error {
			_, err := h(msg)
			return err
		})
	}
	runDone := make(chan error, 1)
	go func() { runDone <- router.Run(ctx) }()
	defer func() {
		_ = router.Close()
		<-runDone
		_ = sub.Close()
	}()
	timeout := time.NewTimer(time.Duration(n)*10*time.Millisecond + time.Minute)
	defer timeout.Stop()
	select {
	case <-done:
	case <-timeout.C:
		return 0, fmt.Errorf("bench: consumed %d of %d messages before the timeout", count.Load(), n)
	case <-ctx.Done():
		return 0, ctx.Err()
	case err := <-runDone:
		runDone <- err
		return 0, fmt.Errorf("bench: router stopped: %v", err)
	}
	if p := failed.Load(); p != nil {
		return 0, fmt.Errorf("bench: a message failed: %w", *p)
	}
	el := time.Duration(lastEnd.Load() - firstStart.Load())
	if el <= 0 {
		return 0, errors.New("bench: no elapsed time")
	}
	return float64(n) / el.Seconds(), nil
}

// rabbitBroker is RabbitMQ: a durable queue per run, persistent messages
// published through amqp091 with our AMQP marshaler; the subscriber is
// watermill-amqp's, each router handler its own channel with the prefetch.
type rabbitBroker struct{ e *env }

func (rabbitBroker) name() string { return "RabbitMQ" }

func (b rabbitBroker) fill(ctx context.Context, msgs []*message.Message) (string, error) {
	q, err := b.e.queue("e2e")
	if err != nil {
		return "", err
	}
	conn, err := amqp091.Dial(b.e.amqpURL)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return "", err
	}
	defer ch.Close()
	m := amqpmarshaler.Marshaler{}
	for _, msg := range msgs {
		p, err := m.Marshal(msg)
		if err != nil {
			return "", err
		}
		if err := ch.PublishWithContext(ctx, "", q, false, false, p); err != nil {
			return "", err
		}
	}
	deadline := time.Now().Add(time.Minute)
	for {
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		if err != nil {
			return "", err
		}
		if st.Messages >= len(msgs) {
			return q, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("bench: queue %s holds %d of %d messages after a minute", q, st.Messages, len(msgs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (b rabbitBroker) subscriber(q string, c e2eCell) (message.Subscriber, string, error) {
	cfg := amqp.NewDurableQueueConfig(b.e.amqpURL)
	cfg.Marshaler = amqpmarshaler.Marshaler{}
	cfg.Consume.Qos.PrefetchCount = c.prefetch
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
	return sub, q, err
}

func (b rabbitBroker) drop(string) { b.e.deleteQueues() }

// jetStreamBroker is NATS JetStream: a stream per run (file storage, one
// subject), filled with JetStream publishes (acked by the server, our
// JetStream marshaler, so each carries Nats-Msg-Id), and a durable push
// consumer with a deliver group, explicit acks, AckWait jsAckWait and
// MaxAckPending = consumers × prefetch (RabbitMQ's prefetch is per channel,
// JetStream's bound per consumer). The subscriber is watermill-nats v2
// pkg/nats in JetStream mode with asynchronous acks (as AMQP's acks are), one
// subscription of the deliver group per router handler.
type jetStreamBroker struct{ e *env }

// jsAckWait is long enough that no message is redelivered during a run (a
// redelivery would be processed twice by none).
const jsAckWait = 5 * time.Minute

// jsDurable is the consumer (and deliver group) of every bench stream; the
// stream's name is unique.
const jsDurable = "bench"

func (jetStreamBroker) name() string { return "NATS JetStream" }

func jsSubject(stream string) string { return stream + ".ev" }

func (b jetStreamBroker) fill(ctx context.Context, msgs []*message.Message) (string, error) {
	js, err := b.e.jetStream()
	if err != nil {
		return "", err
	}
	stream := testenv.UniqueName("bench_e2e")
	if _, err := js.AddStream(&nats.StreamConfig{Name: stream, Subjects: []string{jsSubject(stream)}, Storage: nats.FileStorage}, nats.Context(ctx)); err != nil {
		return "", fmt.Errorf("bench: JetStream add stream: %w", err)
	}
	b.e.trackStream(stream)
	m := jetstream.Marshaler{}
	const batch = 256 // below the client's async publish limit: never stalls
	for i := 0; i < len(msgs); i += batch {
		var futures []nats.PubAckFuture
		for _, msg := range msgs[i:min(i+batch, len(msgs))] {
			nm, err := m.Marshal(jsSubject(stream), msg)
			if err != nil {
				return "", err
			}
			f, err := js.PublishMsgAsync(nm)
			if err != nil {
				return "", fmt.Errorf("bench: JetStream publish: %w", err)
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return "", fmt.Errorf("bench: JetStream publish: %w", err)
			case <-time.After(time.Minute):
				return "", errors.New("bench: JetStream publish not acked within a minute")
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
	}
	si, err := js.StreamInfo(stream, nats.Context(ctx))
	if err != nil {
		return "", err
	}
	if si.State.Msgs != uint64(len(msgs)) {
		return "", fmt.Errorf("bench: stream %s holds %d of %d messages", stream, si.State.Msgs, len(msgs))
	}
	return stream, nil
}

func (b jetStreamBroker) subscriber(stream string, c e2eCell) (message.Subscriber, string, error) {
	js, err := b.e.jetStream()
	if err != nil {
		return nil, "", err
	}
	if _, err := js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable: jsDurable, DeliverSubject: nats.NewInbox(), DeliverGroup: jsDurable,
		AckPolicy: nats.AckExplicitPolicy, AckWait: jsAckWait, DeliverPolicy: nats.DeliverAllPolicy,
		FilterSubject: jsSubject(stream), MaxAckPending: c.consumers * c.prefetch,
	}); err != nil {
		return nil, "", fmt.Errorf("bench: JetStream add consumer: %w", err)
	}
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
		URL: b.e.natsURL, QueueGroupPrefix: jsDurable, SubscribersCount: 1,
		AckWaitTimeout: jsAckWait, CloseTimeout: 10 * time.Second,
		Unmarshaler: jetstream.Marshaler{},
		JetStream:   wmnats.JetStreamConfig{DurablePrefix: jsDurable, AckAsync: true},
	}, watermill.NopLogger{})
	return sub, jsSubject(stream), err
}

func (b jetStreamBroker) drop(stream string) { b.e.dropStream(stream) }

// e2e measures part 3: messages per second from a pre-filled destination
// through the full consumer (subscriber, our marshaler, router, recommended
// chain, handler transaction, ack), with and without our middleware, and
// with 30 % duplicates; over RabbitMQ (every cell of the consumers ×
// prefetch grid, and the headline cell) and over NATS JetStream (the
// headline cell). Each round runs every cell of a transport once, order
// rotated; a ratio is the median of per-round ratios to none of the same
// cell, printed with its spread over the rounds.
func e2e(ctx context.Context, e *env, sz E2ESizes, res *Result) error {
	maxC := sz.HeadConsumers
	for _, c := range sz.Consumers {
		maxC = max(maxC, c)
	}
	rig, err := newE2ERig(ctx, e, "e2e", maxC)
	if err != nil {
		return err
	}
	defer e.closePool(rig.pool)

	hc, hp := sz.HeadConsumers, sz.HeadPrefetch
	// floor_mechanism: the bare claim row (bench/floors.go) end to end, the
	// floor of e2e_ratio any claim row has.
	headCells := []e2eCell{{hc, hp, vNone}, {hc, hp, vOurs}, {hc, hp, vOursDup30}, {hc, hp, vFloorMechanism}}
	var grid []e2eCell
	for _, c := range sz.Consumers {
		for _, p := range sz.Prefetch {
			if c != hc || p != hp {
				grid = append(grid, e2eCell{c, p, vNone}, e2eCell{c, p, vOurs})
			}
		}
	}
	rabbit := e2eTransport{broker: rabbitBroker{e}, key: "", grid: grid, head: headCells,
		title:  "3. end to end over RabbitMQ (pre-filled queue → subscriber → marshaler → router → chain → handler tx → ack)",
		detail: "consumers = router handlers on the queue, each its own AMQP channel with the prefetch; persistent messages, durable queue."}
	jetStream := e2eTransport{broker: jetStreamBroker{e}, key: "_jetstream", head: headCells,
		title: "3b. end to end over NATS JetStream (pre-filled stream → subscriber → marshaler → router → chain → handler tx → ack)",
		detail: fmt.Sprintf("consumers = router handlers, each a subscription of the durable push consumer's deliver group; MaxAckPending = consumers × prefetch; "+
			"file storage, explicit async acks, AckWait %s (no redelivery in a run).", jsAckWait)}
	for _, t := range []e2eTransport{rabbit, jetStream} {
		rig.broker = t.broker
		if err := t.run(ctx, rig, sz, res); err != nil {
			return err
		}
	}
	rig.broker = rabbitBroker{e}
	return nil
}

// e2eTransport is one transport's half of part 3: its cells (the grid's run
// in the first GridRounds rounds only, the headline cells in every round),
// its table and the suffix of its keys ("" for RabbitMQ: e2e_ratio;
// "_jetstream").
type e2eTransport struct {
	broker        e2eBroker
	key           string
	grid, head    []e2eCell
	title, detail string
}

func (t e2eTransport) run(ctx context.Context, rig *e2eRig, sz E2ESizes, res *Result) error {
	e := rig.e
	rates := map[e2eCell][]float64{}
	for r := 0; r < sz.Rounds; r++ {
		cells := t.head
		if sz.GridRounds == 0 || r < sz.GridRounds {
			cells = append(append([]e2eCell{}, t.grid...), t.head...)
		}
		fmt.Fprintf(e.log, "e2e %s: round %d/%d (%d runs of %d messages)\n", t.broker.name(), r+1, sz.Rounds, len(cells), sz.Messages)
		for _, c := range rotate(cells, r) {
			share := 0.0
			if c.variant == vOursDup30 {
				share = 0.3
			}
			dest, err := rig.prefill(ctx, sz.Messages, share)
			if err != nil {
				return fmt.Errorf("bench: e2e %s %+v: %w", t.broker.name(), c, err)
			}
			rate, err := rig.consume(ctx, dest, c, sz.Messages, nil)
			t.broker.drop(dest)
			if err != nil {
				return fmt.Errorf("bench: e2e %s %+v: %w", t.broker.name(), c, err)
			}
			rates[c] = append(rates[c], rate)
		}
	}
	perRound := func(a, b e2eCell) []float64 {
		var xs []float64
		for i := range rates[a] {
			xs = append(xs, ratio(rates[a][i], rates[b][i]))
		}
		return xs
	}
	tab := Table{
		Title:  t.title,
		Header: []string{"consumers", "prefetch", "variant", "msg/s", "× none", "spread"},
	}
	for _, c := range append(append([]e2eCell{}, t.grid...), t.head...) {
		sp := spreadOf(perRound(c, e2eCell{c.consumers, c.prefetch, vNone}))
		spText := sp.short()
		if c.variant == vNone {
			spText = "-" // the baseline: 1 in every round
		}
		tab.Rows = append(tab.Rows, []string{
			strconv.Itoa(c.consumers), strconv.Itoa(c.prefetch), c.variant,
			f0(median(rates[c])), f3(sp.med), spText,
		})
	}
	hc, hp := sz.HeadConsumers, sz.HeadPrefetch
	rounds := fmt.Sprintf("%d rounds", sz.Rounds)
	if len(t.grid) > 0 && sz.GridRounds > 0 && sz.GridRounds < sz.Rounds {
		rounds = fmt.Sprintf("%d rounds (the grid's cells in the first %d)", sz.Rounds, sz.GridRounds)
	}
	tab.Notes = []string{
		fmt.Sprintf("%s × %d messages per run; %s", rounds, sz.Messages, t.detail),
		fmt.Sprintf("e2e_ratio%s is idempotent ÷ none at %d consumers, prefetch %d (median of per-round ratios; spread: their min–max); idempotent_dup30: 30 %% of the messages already processed; "+
			"floor_mechanism: BEGIN and a uuid-only INSERT … ON CONFLICT DO NOTHING in one batch instead of the middleware, the floor of any claim row.", t.key, hc, hp),
	}
	res.Tables = append(res.Tables, tab)
	head := func(v string) e2eCell { return e2eCell{hc, hp, v} }
	res.setRatio("e2e_ratio"+t.key, perRound(head(vOurs), head(vNone)))
	res.setRatio("e2e_dup30_ratio"+t.key, perRound(head(vOursDup30), head(vNone)))
	res.setRatio("e2e_floor_mechanism_ratio"+t.key, perRound(head(vFloorMechanism), head(vNone)))
	res.set("e2e_msg_per_s"+t.key, median(rates[head(vOurs)]))
	return nil
}
