package versioned_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/idempotencytest"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Event ids of case C15 (valid UUIDv7), in increasing byte order.
const (
	lfE1 = "01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b"
	lfE2 = "01906dbc-ad01-70b2-9b2c-3d4e5f6a7b8c"
	lfE3 = "01906dbc-ad02-70c3-ac3d-4e5f6a7b8c9d"
	lfE5 = "01906dbc-ad04-70e5-8e5f-6a7b8c9d0e1f"
	lfE6 = "01906dbc-ad05-70f6-9f6a-7b8c9d0e1f2a"
)

// mysqlTransient is mysqlerr.IsTransient (module middleware/mysqlerr, which
// links the MySQL driver), set by _mysql_test.go in the full test run
// (scripts/test.sh); the MariaDB targets, the only ones that need it, skip
// without it.
var mysqlTransient = func(error) bool { return false }

// redisLatest opens a Redis latest store (versioned/redislatest, a module
// of its own) on a key prefix of the test's own: the store, its prefix and
// a function deleting its keys that returns how many. It is set by
// _latest_redis_test.go, compiled in the full test run (scripts/test.sh):
// the core module requires no Redis client. Without it the "redis" cases
// skip (fail under testenv.FullTestEnv).
var redisLatest func(t testing.TB, ttl time.Duration) (store versioned.LatestStore, prefix string, forget func() int)

func requireRedisLatest(t testing.TB) {
	t.Helper()
	if redisLatest != nil {
		return
	}
	if os.Getenv(testenv.FullTestEnv) != "" {
		t.Fatalf("the Redis latest store is not linked although %s is set (run scripts/test.sh)", testenv.FullTestEnv)
	}
	t.Skip("the Redis latest store (module versioned/redislatest) is not linked into the core module's tests; scripts/test.sh runs this case")
}

// lfQueue is a message.Publisher standing for the broker: it keeps copies of
// what was published, in order. fail, when set, makes Publish fail.
type lfQueue struct {
	mu   sync.Mutex
	msgs []*message.Message
	fail error
}

func (q *lfQueue) Publish(_ string, msgs ...*message.Message) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.fail != nil {
		return q.fail
	}
	for _, m := range msgs {
		q.msgs = append(q.msgs, m.Copy())
	}
	return nil
}

func (q *lfQueue) Close() error { return nil }

// take returns and forgets everything queued.
func (q *lfQueue) take() []*message.Message {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.msgs
	q.msgs = nil
	return out
}

func (q *lfQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.msgs)
}

// lfOutcomes counts the idempotent middleware's outcomes.
type lfOutcomes = idempotencytest.Outcomes

// lfEnv is one consumer service: a schema with the processed-event table,
// the family tables and a state table, the idempotent middleware and the
// latest filter over PostgreSQL or Redis.
type lfEnv struct {
	t        *testing.T
	tg       testenv.Target
	pool     *pgxpool.Pool // the postgres-pgx target's; nil on the others
	db       sqldb.Querier
	schema   string
	families *versioned.FamilyStore
	latest   versioned.LatestStore
	store    string // "postgres" or "redis"

	redisPrefix string
	forgetRedis func() int // deletes the test's Redis keys, returns how many

	processed *processedstore.Store

	outcomes *lfOutcomes
	counter  *versioned.FilterCounter
	beginner inbox.TxBeginner
}

// lfStores are the latest stores every filter test runs against.
var lfStores = []string{"postgres", "redis"}

func newLFEnv(t *testing.T, store string) *lfEnv {
	return newLFEnvWith(t, store, "pgx")
}

// newLFEnvWith opens the environment with the given latest store
// ("postgres": the SQL FamilyStore of the environment's database, whatever
// its dialect; "redis") on the given target: "pgx" or "database/sql"
// (PostgreSQL), or one of testenv.TargetNames. The idempotent middleware
// runs on the target's driver.
func newLFEnvWith(t *testing.T, store, target string) *lfEnv {
	t.Helper()
	ctx := context.Background()
	switch target {
	case "pgx":
		target = testenv.TargetPostgresPgx
	case "database/sql":
		target = testenv.TargetPostgresStdlib
	}
	tg := testenv.NewTarget(t, target, 8)
	e := &lfEnv{t: t, tg: tg, pool: tg.Pgx, db: tg.DB, schema: tg.Database, store: store,
		outcomes: &lfOutcomes{}, counter: &versioned.FilterCounter{}}
	ps, err := processedstore.NewStore(processedstore.Config{Dialect: tg.Dialect})
	require.NoError(t, err)
	require.NoError(t, ps.Migrate(ctx, e.db))
	e.processed = ps
	e.families, err = versioned.NewFamilyStore(versioned.FamilyStoreConfig{Dialect: tg.Dialect})
	require.NoError(t, err)
	require.NoError(t, e.families.Migrate(ctx, e.tg.Handle()))
	ddl := `CREATE TABLE state_copy (family_id text PRIMARY KEY, value text NOT NULL, event_id uuid NOT NULL)`
	switch tg.Dialect {
	case sqldb.MySQL:
		ddl = `CREATE TABLE state_copy (family_id varchar(255) PRIMARY KEY, value text NOT NULL, event_id char(36) NOT NULL)`
	case sqldb.SQLite:
		ddl = `CREATE TABLE state_copy (family_id text PRIMARY KEY, value text NOT NULL, event_id text NOT NULL)`
	}
	tg.Exec(t, ddl)
	switch store {
	case "postgres":
		e.latest = e.families
	case "redis":
		requireRedisLatest(t)
		e.latest, e.redisPrefix, e.forgetRedis = redisLatest(t, time.Hour)
	default:
		t.Fatalf("unknown store %q", store)
	}
	if tg.Pgx != nil {
		e.beginner = mustBeginner(inbox.NewPgxBeginner(tg.Pgx, inbox.PgxBeginnerConfig{}))
	} else {
		e.beginner = mustBeginner(inbox.NewStdBeginner(tg.Std))
	}
	return e
}

// forgetLatest drops every latest record (a purge, an expiry, a flush).
func (e *lfEnv) forgetLatest() {
	e.t.Helper()
	if e.store == "redis" {
		e.forgetRedis()
		return
	}
	_, err := e.db.Exec(context.Background(), `DELETE FROM family_latest`)
	require.NoError(e.t, err)
}

// forgetProcessed deletes the processed-event row of eventID (a purge).
func (e *lfEnv) forgetProcessed(eventID string) {
	e.t.Helper()
	id := uuid.MustParse(eventID)
	var arg any = eventID
	if e.tg.Dialect != sqldb.PostgreSQL {
		arg = id[:] // BINARY(16) / BLOB
	}
	_, err := e.db.Exec(context.Background(), e.tg.Rebind(`DELETE FROM processed_event WHERE event_id = $1`), arg)
	require.NoError(e.t, err)
	if e.tg.Dialect == sqldb.PostgreSQL { // and its row of processed migration 8's UUIDv7 table
		_, err := e.db.Exec(context.Background(), `DELETE FROM processed_event_v7 WHERE event_id = $1`, arg)
		require.NoError(e.t, err)
	}
}

// publisher returns a LatestPublisher in front of q that records in the
// environment's latest store (in the pool's autocommit for PostgreSQL: q
// stands for a broker).
func (e *lfEnv) publisher(q message.Publisher) *versioned.LatestPublisher {
	e.t.Helper()
	p, err := versioned.NewLatestPublisher(q, versioned.LatestPublisherConfig{Store: e.latest, Tx: testenv.AsTx(e.db)}, nil)
	require.NoError(e.t, err)
	return p
}

// filter builds a LatestFilter for consumer, recording into e.counter.
func (e *lfEnv) filter(consumer string) *versioned.LatestFilter {
	e.t.Helper()
	f, err := versioned.NewRecordedLatestFilter(versioned.LatestFilterConfig{
		Families: e.families,
		Latest:   e.latest,
		Consumer: consumer,
	}, e.counter, watermill.NopLogger{})
	require.NoError(e.t, err)
	return f
}

// chain is Recoverer → Idempotent → LatestFilter → h, for consumer.
func (e *lfEnv) chain(consumer string, h message.HandlerFunc) message.HandlerFunc {
	e.t.Helper()
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: e.beginner,
		Store:    e.processed,
		Consumer: consumer,
		Recorder: e.outcomes,
	}, watermill.NopLogger{})
	require.NoError(e.t, err)
	return wmw.Recoverer(idem.Middleware(e.filter(consumer).Middleware(h)))
}

// stateHandler writes the message's payload "value" to state_copy,
// unconditionally (the filter provides the order), and reports each call.
func (e *lfEnv) stateHandler(calls func(msg *message.Message)) message.HandlerFunc {
	query := `INSERT INTO state_copy (family_id, value, event_id) VALUES ($1, $2, $3)
			ON CONFLICT (family_id) DO UPDATE SET value = EXCLUDED.value, event_id = EXCLUDED.event_id`
	if e.tg.Dialect == sqldb.MySQL {
		query = `INSERT INTO state_copy (family_id, value, event_id) VALUES (?, ?, ?)
			ON DUPLICATE KEY UPDATE value = VALUES(value), event_id = VALUES(event_id)`
	}
	query = e.tg.Rebind(query)
	return func(msg *message.Message) ([]*message.Message, error) {
		calls(msg)
		q, ok := inbox.QuerierFromContext(msg.Context())
		if !ok {
			return nil, fmt.Errorf("no transaction")
		}
		id := msg.Metadata.Get(versioned.MetadataFamilyID)
		_, err := q.Exec(msg.Context(), query, id, string(msg.Payload), msg.UUID)
		return nil, err
	}
}

func (e *lfEnv) state(id string) (value, eventID string) {
	e.t.Helper()
	query := `SELECT value, event_id FROM state_copy WHERE family_id = $1`
	if e.tg.Dialect == sqldb.PostgreSQL {
		query = `SELECT value, event_id::text FROM state_copy WHERE family_id = $1`
	}
	require.NoError(e.t, e.db.QueryRow(context.Background(), e.tg.Rebind(query), id).Scan(&value, &eventID))
	return value, eventID
}

func (e *lfEnv) count(query string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.QueryRow(context.Background(), e.tg.Rebind(query), args...).Scan(&n))
	return n
}

// deliver hands h a copy of msg, as the broker would (fresh context, same
// event id, metadata and payload), under a handler name.
func deliver(h message.HandlerFunc, msg *message.Message) error {
	d := msg.Copy()
	d.SetContext(context.Background())
	_, err := h(d)
	return err
}

// lfMsg builds an event with the given id, occurred_at text, family and
// payload (a JSON string of value). seq < 0 means no sequence number.
func lfMsg(t testing.TB, id string, occurredAt string, f versioned.Family, seq int64, value string) *message.Message {
	t.Helper()
	eventID := uuid.MustParse(id)
	msg, err := marshaler.NewMessageWithID(eventID, "customer.status", time.Now(), value)
	require.NoError(t, err)
	msg.Payload = message.Payload(value)
	if occurredAt != "" {
		msg.Metadata.Set(marshaler.MetadataOccurredAt, occurredAt)
	}
	if seq >= 0 {
		require.NoError(t, versioned.SetFamilySeq(msg, f, seq))
	} else {
		require.NoError(t, versioned.SetFamily(msg, f))
	}
	return msg
}

// lfSeqMsg is a numbered update with a fresh UUIDv7.
func lfSeqMsg(t testing.TB, f versioned.Family, seq int64) *message.Message {
	t.Helper()
	return lfMsg(t, uuid.Must(uuid.NewV7()).String(), "", f, seq, fmt.Sprintf("v%d", seq))
}

// lfShuffle shuffles msgs deterministically.
func lfShuffle(seed uint64, msgs []*message.Message) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	r.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
}

// mustBeginner unwraps a beginner constructor's result in tests, whose
// handles are never nil.
func mustBeginner(b inbox.TxBeginner, err error) inbox.TxBeginner {
	if err != nil {
		panic(err)
	}
	return b
}
