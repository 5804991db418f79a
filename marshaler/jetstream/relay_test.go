package jetstream

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// relayRecorder counts what the relay reports.
type relayRecorder struct {
	mu                                 sync.Mutex
	published, failed, pressured, dead int
}

func (r *relayRecorder) Round(n int) { r.mu.Lock(); r.published += n; r.mu.Unlock() }
func (r *relayRecorder) PublishFailed(string) {
	r.mu.Lock()
	r.failed++
	r.mu.Unlock()
}
func (r *relayRecorder) BackPressured(string)       { r.mu.Lock(); r.pressured++; r.mu.Unlock() }
func (r *relayRecorder) DeadLettered(string)        { r.mu.Lock(); r.dead++; r.mu.Unlock() }
func (r *relayRecorder) Pending(int, time.Duration) {}

func (r *relayRecorder) counts() (published, failed, pressured, dead int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.published, r.failed, r.pressured, r.dead
}

// relayFixture is an outbox on a schema of its own, a JetStream context,
// and the relay's probe subject, which no stream takes.
type relayFixture struct {
	pool  *pgxpool.Pool
	ob    *outbox.Outbox
	js    nats.JetStreamContext
	url   string
	probe string // the probe topic, a subject no stream takes
}

func newRelayFixture(t *testing.T) *relayFixture {
	t.Helper()
	url := natsURL(t)
	_, js := testStream(t, url)
	pool, _ := testenv.Pool(t)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool)}, watermill.NopLogger{})
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(context.Background()))
	// The default probe publishes through the relay's publisher to a
	// subject no stream takes: its unroutable answer shows the server up
	// (RelayConfig.ProbeTopic: nothing needs binding there).
	probe := testStreamName() + ".probe"
	return &relayFixture{pool: pool, ob: ob, js: js, url: url, probe: probe}
}

// write commits a row for topic and returns its event id.
func (f *relayFixture) write(t *testing.T, topic string) string {
	t.Helper()
	return f.writePayload(t, topic, map[string]int{"order_id": 1})
}

// writePayload commits a row for topic with payload (as JSON) and returns
// its event id.
func (f *relayFixture) writePayload(t *testing.T, topic string, payload any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	pub, err := f.ob.PgxPublisher(tx)
	require.NoError(t, err)
	msg, err := marshaler.NewMessage("order.placed", payload)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, msg))
	require.NoError(t, tx.Commit(ctx))
	return msg.UUID
}

// rows returns the outbox's pending and dead-lettered rows.
func (f *relayFixture) rows(t *testing.T) (pending, dead int) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, f.pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&pending))
	require.NoError(t, f.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_dead").Scan(&dead))
	return pending, dead
}

// run starts the relay publishing with NewPublisher until the test ends.
func (f *relayFixture) run(t *testing.T, maxAttempts int) *relayRecorder {
	t.Helper()
	pub, err := NewPublisher(PublisherConfig{URL: f.url})
	require.NoError(t, err)
	rec := &relayRecorder{}
	relay, err := f.ob.NewRelay(pub, outbox.RelayConfig{
		MaxAttempts:   maxAttempts,
		RetryInterval: 10 * time.Millisecond,
		MaxBackoff:    50 * time.Millisecond,
		PollInterval:  10 * time.Millisecond,
		ProbeTopic:    f.probe,
		Recorder:      rec,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		require.NoError(t, relay.Close())
		require.NoError(t, pub.Close())
	})
	return rec
}

// stored returns the event id of the last message stored on subject ("" if none).
func (f *relayFixture) stored(t *testing.T, subject string) string {
	t.Helper()
	m, err := f.js.GetLastMsg(streamOf(subject), subject)
	if err != nil {
		return ""
	}
	msg, _ := Marshaler{}.Unmarshal(&nats.Msg{Subject: m.Subject, Header: m.Header, Data: m.Data})
	return msg.UUID
}

// streamOf is the stream of a subject "<stream>.<...>" made by newStream.
func streamOf(subject string) string {
	for i := range subject {
		if subject[i] == '.' {
			return subject[:i]
		}
	}
	return subject
}

const relayMaxAttempts = 3

// TestRelayFullStreamIsBackPressureAndRowIsDeliveredOnceRoomIsMade: a
// stream at its limit with DiscardNew refuses the relay's publish ("maximum
// messages exceeded", "maximum bytes exceeded"), as a RabbitMQ queue at
// x-max-length with reject-publish nacks it. The row would fit the stream
// once it has room, so through NewPublisher that is back-pressure: the
// row fails more than MaxAttempts times and is never dead-lettered, and it
// goes out once the stream has room.
func TestRelayFullStreamIsBackPressureAndRowIsDeliveredOnceRoomIsMade(t *testing.T) {
	t.Parallel()
	t.Run("MaxMsgs", func(t *testing.T) {
		t.Parallel()
		testRelayFullStream(t, nats.StreamConfig{MaxMsgs: 1, Discard: nats.DiscardNew}, []byte("{}"))
	})
	t.Run("MaxBytes", func(t *testing.T) { // 3900 of 4096 bytes stored: a row of ~400 does not fit beside them
		t.Parallel()
		testRelayFullStream(t, nats.StreamConfig{MaxBytes: 4096, Discard: nats.DiscardNew}, make([]byte, 3900))
	})
}

func testRelayFullStream(t *testing.T, limits nats.StreamConfig, filler []byte) {
	f := newRelayFixture(t)
	full := newStream(t, f.js, limits)
	_, err := f.js.Publish(full+".filler", filler) // the stream is now at its limit
	require.NoError(t, err)
	subject := full + ".orders"
	id := f.write(t, subject)

	rec := f.run(t, relayMaxAttempts)
	testenv.Eventually(t, 30*time.Second, "publishes refused by the full stream, past MaxAttempts", func(o *testenv.Observed) bool {
		_, failed, pressured, dead := rec.counts()
		o.Int("failed", failed)
		o.Int("back-pressured", pressured)
		return o.Int("dead", dead) > 0 || pressured > relayMaxAttempts+2
	})
	pending, dead := f.rows(t)
	require.Zero(t, dead, "a full stream (back-pressure) dead-lettered the row")
	require.Equal(t, 1, pending, "the row waits in the outbox for room in the stream")

	require.NoError(t, f.js.PurgeStream(full)) // a consumer drained the stream
	testenv.Eventually(t, 30*time.Second, "the row published once the stream has room", func(o *testenv.Observed) bool {
		pending, _ := f.rows(t)
		return o.Int("pending", pending) == 0 && o.Str("stored", f.stored(t, subject)) == id
	})
	_, dead = f.rows(t)
	require.Zero(t, dead)
	_, _, _, recDead := rec.counts()
	require.Zero(t, recDead)
}

// TestRelayRowLargerThanItsStreamCanEverHoldIsDeadLetteredAndItsSubjectGoesOn:
// a row whose headers and data alone reach its stream's MaxBytes
// (DiscardNew) is refused at every attempt ("maximum bytes exceeded", the
// error of a full stream), also by the stream when it holds nothing: it
// can never fit, so it is not back-pressure (producer.md: "A bad row does
// not wedge it"). With the probe going through it is the row's fault:
// dead-lettered after MaxAttempts, with the reason, and the row behind it
// on its subject is published.
func TestRelayRowLargerThanItsStreamCanEverHoldIsDeadLetteredAndItsSubjectGoesOn(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t)
	limited := newStream(t, f.js, nats.StreamConfig{MaxBytes: 1024, Discard: nats.DiscardNew})
	subject := limited + ".orders"
	big := f.writePayload(t, subject, map[string]string{"note": strings.Repeat("x", 2048)})
	next := f.write(t, subject)

	rec := f.run(t, relayMaxAttempts)
	testenv.Eventually(t, 20*time.Second, "the row that can never fit dead-lettered, the next one published", func(o *testenv.Observed) bool {
		pending, dead := f.rows(t)
		_, failed, pressured, recorded := rec.counts()
		o.Int("failed", failed)
		o.Int("back-pressured", pressured)
		// The next row leaves the outbox in the settle after its publish.
		return o.Int("dead", dead) == 1 && o.Int("recorded dead", recorded) == 1 && o.Str("stored", f.stored(t, subject)) == next &&
			o.Int("pending", pending) == 0
	})
	var id, reason string
	var attempts int
	require.NoError(t, f.pool.QueryRow(context.Background(), "SELECT event_id, attempts, reason FROM outbox_dead").Scan(&id, &attempts, &reason))
	require.Equal(t, big, id)
	require.Equal(t, relayMaxAttempts, attempts, "dead-lettered after MaxAttempts, as a row the stream refuses")
	require.Contains(t, reason, limited, "the reason names the stream")
}

// TestRelayRowOfSubjectWithoutStreamWaitsForAStream: no stream takes the
// row's subject yet (its consumer is not deployed): JetStream answers "no
// responders", NewPublisher reports it unroutable, and the row waits, past
// MaxAttempts, while the probe shows the broker up ("A topic with no queue
// yet waits"); once a stream takes the subject, the row goes out.
func TestRelayRowOfSubjectWithoutStreamWaitsForAStream(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t)
	notYet := testStreamName() // its stream is not created yet
	subject := notYet + ".orders"
	id := f.write(t, subject)

	rec := f.run(t, relayMaxAttempts)
	testenv.Eventually(t, 60*time.Second, "publishes to a subject without a stream, past MaxAttempts", func(o *testenv.Observed) bool {
		_, failed, _, dead := rec.counts()
		return o.Int("dead", dead) > 0 || o.Int("failed", failed) > relayMaxAttempts+2
	})
	pending, dead := f.rows(t)
	require.Zero(t, dead, "a subject with no stream yet dead-lettered the row")
	require.Equal(t, 1, pending, "the row waits in the outbox for a stream")

	_, err := f.js.AddStream(&nats.StreamConfig{Name: notYet, Subjects: []string{notYet + ".>"}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = f.js.DeleteStream(notYet) })
	testenv.Eventually(t, 30*time.Second, "the row published once a stream takes its subject", func(o *testenv.Observed) bool {
		pending, _ := f.rows(t)
		return o.Int("pending", pending) == 0 && o.Str("stored", f.stored(t, subject)) == id
	})
	_, dead = f.rows(t)
	require.Zero(t, dead)
}

// TestRelayDeadLettersRowTheStreamRefuses: a row larger than the stream's
// MaxMsgSize is the row's fault (every attempt meets the limit again): with
// the probe going through, it is dead-lettered after MaxAttempts.
func TestRelayDeadLettersRowTheStreamRefuses(t *testing.T) {
	t.Parallel()
	f := newRelayFixture(t)
	small := newStream(t, f.js, nats.StreamConfig{MaxMsgSize: 16})
	f.write(t, small+".orders")

	rec := f.run(t, relayMaxAttempts)
	testenv.Eventually(t, 30*time.Second, "the row dead-lettered", func(o *testenv.Observed) bool {
		_, dead := f.rows(t)
		_, _, _, recorded := rec.counts() // recorded after the round's failures
		return o.Int("dead", dead) == 1 && o.Int("recorded dead", recorded) == 1
	})
	pending, _ := f.rows(t)
	require.Zero(t, pending)
	_, failed, pressured, _ := rec.counts()
	require.Equal(t, relayMaxAttempts, failed)
	require.Zero(t, pressured)
}
