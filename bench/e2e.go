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
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-idempotency/idempotency/marshaler"
	amqpmarshaler "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	"github.com/watermill-idempotency/idempotency/processed"
)

const vOursDup30 = "idempotent_dup30" // our middleware, 30 % of the messages already processed

type e2eCell struct {
	consumers, prefetch int
	variant             string
}

// e2eRig is one schema, pool and store for the end-to-end runs.
type e2eRig struct {
	e     *env
	pool  *pgxpool.Pool
	store *processed.Store
	vs    *variantSet
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
	if _, err := pool.Exec(ctx, handlerSchema); err != nil {
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
	return &e2eRig{e: e, pool: pool, store: store, vs: vs}, nil
}

// prefill publishes n events (persistent, through our marshaler) to a new
// queue, a share dupShare of them with ids already processed, and waits
// until the broker holds them all.
func (r *e2eRig) prefill(ctx context.Context, n int, dupShare float64) (string, error) {
	q, err := r.e.queue("e2e")
	if err != nil {
		return "", err
	}
	nDup := int(float64(n) * dupShare)
	var dups []uuid.UUID
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

	conn, err := amqp091.Dial(r.e.amqpURL)
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
	for i := 0; i < n; i++ {
		var msg *message.Message
		if isDup[i] {
			msg, err = marshaler.NewMessageWithID(dups[0], eventName, time.Now().UTC(), payload())
			dups = dups[1:]
		} else {
			msg, err = newV7()
		}
		if err != nil {
			return "", err
		}
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
		if st.Messages >= n {
			return q, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("bench: queue %s holds %d of %d messages after a minute", q, st.Messages, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// consume runs a Watermill router on q (consumers handlers, each its own
// AMQP channel with the prefetch) with the variant's chain, until n messages
// went through the chain; it returns the rate between the first message's
// arrival and the n-th's return. progress, if set, is called with the count
// after each message (memory sampling).
func (r *e2eRig) consume(ctx context.Context, q string, c e2eCell, n int, progress func(int64)) (float64, error) {
	cfg := amqp.NewDurableQueueConfig(r.e.amqpURL)
	cfg.Marshaler = amqpmarshaler.Marshaler{}
	cfg.Consume.Qos.PrefetchCount = c.prefetch
	sub, err := amqp.NewSubscriber(cfg, watermill.NopLogger{})
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
		router.AddConsumerHandler("bench_"+strconv.Itoa(i), q, sub, func(msg *message.Message) error {
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

// e2e measures part 3: messages per second from a pre-filled queue through
// the full consumer (AMQP subscriber, our marshaler, router, recommended
// chain, handler transaction, ack), with and without our middleware, and
// with 30 % duplicates. Each round runs every cell once, order rotated; the
// ratio is the median of per-round ratios to none of the same cell.
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

	var cells []e2eCell
	head := func(c, p int) bool { return c == sz.HeadConsumers && p == sz.HeadPrefetch }
	for _, c := range sz.Consumers {
		for _, p := range sz.Prefetch {
			if !head(c, p) {
				cells = append(cells, e2eCell{c, p, vNone}, e2eCell{c, p, vOurs})
			}
		}
	}
	hc, hp := sz.HeadConsumers, sz.HeadPrefetch
	cells = append(cells, e2eCell{hc, hp, vNone}, e2eCell{hc, hp, vOurs}, e2eCell{hc, hp, vOursDup30})

	rates := map[e2eCell][]float64{}
	one := func(c e2eCell) (float64, error) {
		share := 0.0
		if c.variant == vOursDup30 {
			share = 0.3
		}
		q, err := rig.prefill(ctx, sz.Messages, share)
		if err != nil {
			return 0, err
		}
		return rig.consume(ctx, q, c, sz.Messages, nil)
	}
	for r := 0; r < sz.Rounds; r++ {
		fmt.Fprintf(e.log, "e2e: round %d/%d (%d runs of %d messages)\n", r+1, sz.Rounds, len(cells), sz.Messages)
		for _, c := range rotate(cells, r) {
			rate, err := one(c)
			if err != nil {
				return fmt.Errorf("bench: e2e %+v: %w", c, err)
			}
			rates[c] = append(rates[c], rate)
		}
		e.deleteQueues()
	}
	perRound := func(a, b e2eCell) float64 {
		var xs []float64
		for i := range rates[a] {
			xs = append(xs, ratio(rates[a][i], rates[b][i]))
		}
		return median(xs)
	}
	t := Table{
		Title:  "3. end to end over RabbitMQ (pre-filled queue → subscriber → marshaler → router → chain → handler tx → ack)",
		Header: []string{"consumers", "prefetch", "variant", "msg/s", "× none"},
	}
	for _, c := range cells {
		t.Rows = append(t.Rows, []string{
			strconv.Itoa(c.consumers), strconv.Itoa(c.prefetch), c.variant,
			f0(median(rates[c])), f3(perRound(c, e2eCell{c.consumers, c.prefetch, vNone})),
		})
	}
	t.Notes = []string{
		fmt.Sprintf("%d rounds × %d messages per run; consumers = router handlers on the queue, each its own AMQP channel; persistent messages, durable queue.", sz.Rounds, sz.Messages),
		fmt.Sprintf("e2e_ratio is idempotent ÷ none at %d consumers, prefetch %d; idempotent_dup30: 30 %% of the messages already processed.", hc, hp),
	}
	res.Tables = append(res.Tables, t)
	res.set("e2e_ratio", perRound(e2eCell{hc, hp, vOurs}, e2eCell{hc, hp, vNone}))
	res.set("e2e_dup30_ratio", perRound(e2eCell{hc, hp, vOursDup30}, e2eCell{hc, hp, vNone}))
	res.set("e2e_msg_per_s", median(rates[e2eCell{hc, hp, vOurs}]))
	return nil
}
