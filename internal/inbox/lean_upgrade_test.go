package inbox_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// The previous release's claim, frozen: its BEGIN, SET LOCAL lock_timeout
// and claim statement with payload verification and a 1 h horizon, exactly
// as it sent them (text consumer, event_at always written, the window as
// the WHERE of an INSERT … SELECT).
const (
	previousLockTimeout = `SET LOCAL lock_timeout = '5000ms'`
	previousClaim       = "INSERT INTO \"processed_event\" (consumer, event_id, event_at, event_name, fingerprint)\nSELECT $1, $2, coalesce($3::timestamptz, now()), $4, $5\nWHERE $3::timestamptz IS NULL\n   OR $3::timestamptz BETWEEN now() - interval '3600000000 microseconds' AND now() + interval '300000000 microseconds'\nON CONFLICT DO NOTHING"
)

// previousFingerprint is the previous release's fingerprint (version 2):
// 0x02 ‖ the first 8 bytes of SHA-256(uvarint(len(name)) ‖ name ‖
// payload). The new release compares it with the same bytes' SHA-256.
func previousFingerprint(name, payload string) []byte {
	sum := sha256.Sum256([]byte(string(binary.AppendUvarint(nil, uint64(len(name)))) + name + payload))
	return append([]byte{2}, sum[:8]...)
}

// previousRelease applies one delivery as the previous release's consumer
// did: claim and effect in one transaction; 0 rows: a duplicate, nothing
// applied. It returns the error of a failed attempt (retried by the caller).
func previousRelease(ctx context.Context, pool *pgxpool.Pool, id uuid.UUID, payload string) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, previousLockTimeout); err != nil {
		return err
	}
	at, _ := processedstore.EventTime(id, time.Now())
	tag, err := tx.Exec(ctx, previousClaim, "stock", id, at, "order.placed", previousFingerprint("order.placed", payload))
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `INSERT INTO effect (event_id, note) VALUES ($1, 'previous')`, id); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// A rolling deploy of the lean claim (migration 0007): events claimed by
// the previous release before the migration stay duplicates for the new
// one; while the migration runs and after it, consumers of both releases
// receive the same events at once (UUIDv7 ids, which the new release
// writes without event_at, and v4 ids), and every event is applied exactly
// once, whichever side claims it. On the code before the lean claim the
// new side's claim is the previous one, so this checks the migration and
// the new statement keep the key shared, not an old behaviour; without
// migration 0007 the new release's UUIDv7 rows would carry an event_at,
// which the test also checks is absent.
func TestLeanClaimRollingDeployAppliesEachEventOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Pool(t)
	store, err := processedstore.NewStore(processedstore.Config{Horizon: time.Hour})
	require.NoError(t, err)
	ms, err := store.Migrations()
	require.NoError(t, err)
	require.Len(t, ms, 9)
	// The previous release's schema: migrations 1 to 6.
	require.NoError(t, sqldb.Migrate(ctx, sqldb.Pgx(pool), sqldb.PostgreSQL, "processed:"+store.Table().String(), ms[:6]))
	_, err = pool.Exec(ctx, `CREATE TABLE effect (id bigserial PRIMARY KEY, event_id uuid NOT NULL, note text)`)
	require.NoError(t, err)

	const payload = `{"n":1}`
	before := mixedIDs(40)
	for _, id := range before {
		require.NoError(t, previousRelease(ctx, pool, id, payload))
	}

	beginner, err := inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})
	require.NoError(t, err)
	m, err := inbox.NewIdempotent(inbox.Config{Beginner: beginner, Store: store, Consumer: "stock"}, watermill.NopLogger{})
	require.NoError(t, err)
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect (event_id, note) VALUES ($1, 'lean')`, pgx.QueryExecModeSimpleProtocol, msg.UUID)
		return nil, err
	})
	deliverNew := func(id uuid.UUID) error {
		_, err := h(preparedClaimMsg(t, id, payload))
		return err
	}

	// During the deploy: two workers of each release on the same events,
	// each delivered three times, the migration applied midway. The events
	// claimed before the migration are delivered again too.
	during := mixedIDs(120)
	var deliveries []uuid.UUID
	for i := 0; i < 3; i++ {
		deliveries = append(deliveries, during...)
		deliveries = append(deliveries, before...)
	}
	rand.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	var (
		next     atomic.Int64
		migrated = make(chan error, 1)
		wg       sync.WaitGroup
		failures atomic.Int64
	)
	worker := func(deliver func(uuid.UUID) error) {
		defer wg.Done()
		for {
			i := int(next.Add(1)) - 1
			if i >= len(deliveries) {
				return
			}
			if i == len(deliveries)/3 {
				go func() { migrated <- store.Migrate(ctx, sqldb.Pgx(pool)) }()
			}
			for try := 0; ; try++ {
				err := deliver(deliveries[i])
				if err == nil {
					break
				}
				// Held failures (a lock wait bounded by the lock timeout,
				// a plan invalidated by the migration's ALTER) are retried,
				// as the broker would redeliver.
				failures.Add(1)
				require.Less(t, try, 100, "delivery %s keeps failing: %v", deliveries[i], err)
				time.Sleep(time.Millisecond)
			}
		}
	}
	wg.Add(4)
	go worker(func(id uuid.UUID) error { return previousRelease(ctx, pool, id, payload) })
	go worker(func(id uuid.UUID) error { return previousRelease(ctx, pool, id, payload) })
	go worker(deliverNew)
	go worker(deliverNew)
	wg.Wait()
	require.NoError(t, <-migrated)
	t.Logf("failed attempts retried: %d", failures.Load())

	// After the deploy: both releases still see every event as processed.
	for _, id := range append(append([]uuid.UUID{}, before...), during...) {
		require.NoError(t, deliverNew(id))
		require.NoError(t, previousRelease(ctx, pool, id, payload))
	}
	after := mixedIDs(20)
	for _, id := range after {
		require.NoError(t, deliverNew(id))
		require.NoError(t, previousRelease(ctx, pool, id, payload))
		require.NoError(t, deliverNew(id))
	}

	all := append(append(append([]uuid.UUID{}, before...), during...), after...)
	var effects, rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT event_id) FROM effect`).Scan(&effects, &rows))
	require.Equal(t, len(all), effects, "every event applied exactly once")
	require.Equal(t, len(all), rows)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&rows))
	require.Equal(t, len(all), rows)

	// The lean claim's UUIDv7 rows (after the migration) carry no
	// event_at; its other rows and the previous release's do.
	var leanNull, leanV4Null, previousNull int
	require.NoError(t, pool.QueryRow(ctx, `SELECT
    count(*) FILTER (WHERE f.note = 'lean' AND p.event_at IS NULL AND get_byte(uuid_send(p.event_id), 6) >> 4 = 7),
    count(*) FILTER (WHERE f.note = 'lean' AND p.event_at IS NULL AND get_byte(uuid_send(p.event_id), 6) >> 4 <> 7),
    count(*) FILTER (WHERE f.note = 'previous' AND p.event_at IS NULL)
FROM processed_event p JOIN effect f USING (event_id)`).Scan(&leanNull, &leanV4Null, &previousNull))
	require.Positive(t, leanNull, "UUIDv7 rows of the lean claim have no event_at")
	require.Zero(t, leanV4Null)
	require.Zero(t, previousNull)
}

// mixedIDs returns n new event ids, one in four a UUIDv4 (whose claim
// stays in the table), the others UUIDv7.
func mixedIDs(n int) []uuid.UUID {
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		if i%4 == 3 {
			ids = append(ids, uuid.New())
		} else {
			ids = append(ids, uuid.Must(uuid.NewV7()))
		}
	}
	return ids
}
