package inbox_test

import (
	"context"
	"database/sql"
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// uuidV7At returns a UUIDv7 whose timestamp is at (RFC 9562 §5.7).
func uuidV7At(at time.Time) uuid.UUID {
	return withV7Time(uuid.Must(uuid.NewV7()), at)
}

// withV7Time returns id with its 48-bit millisecond timestamp set to at.
func withV7Time(id uuid.UUID, at time.Time) uuid.UUID {
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(at.UnixMilli()))
	copy(id[0:6], ms[2:8])
	return id
}

func v7Time(id uuid.UUID) time.Time {
	sec, nsec := id.Time().UnixTime()
	return time.Unix(sec, nsec)
}

// horizonEnv is env with a store whose claim enforces horizon and skew.
func horizonEnv(t *testing.T, horizon, skew time.Duration) *env {
	t.Helper()
	e := newEnv(t)
	s, err := processedstore.NewStore(processedstore.Config{Horizon: horizon, MaxFutureSkew: skew})
	require.NoError(t, err)
	e.store = s
	return e
}

// effectsNoted counts the effects written with note (one logical event
// keeps its note while the test moves its id through time).
func (e *env) effectsNoted(note string) int {
	return e.count(`SELECT count(*) FROM effect WHERE note = $1`, note)
}

// advance moves the world forward by d as the database clock sees it: the
// event's time, and every time stored for it, move back by d. For a UUIDv7
// the time is in the id, so the stored row takes the moved id, and the
// caller redelivers that id: the same event, d later. (now() cannot be
// faked; moving the event's time is the same thing to every statement.)
func (e *env) advance(id uuid.UUID, d time.Duration) uuid.UUID {
	e.t.Helper()
	moved := withV7Time(id, v7Time(id).Add(-d))
	_, err := e.pool.Exec(context.Background(), `UPDATE processed_event
		SET event_id = $2, event_at = event_at - $3::bigint * interval '1 microsecond',
		    processed_at = processed_at - $3::bigint * interval '1 microsecond'
		WHERE event_id = $1`, id, moved, d.Microseconds())
	require.NoError(e.t, err)
	return moved
}

// The case and its neighbours: whatever the producer's clock says
// (up to 59 min ahead of the database, 30 min behind, or right), with the
// purge horizon equal to the claim's, every redelivery after every purge
// either finds its row (duplicate) or is refused as expired; the effect is
// applied once. Before, the middleware judged age by the consumer's clock
// on the event time while the purge deleted by the database clock on
// processed_at: an event 30 min ahead was purged 2 h after processing and
// its redelivery, judged 1 h 31 min old, was applied again.
func TestClockSkewRedeliveryFindsRowOrIsExpired(t *testing.T) {
	t.Parallel()
	const horizon = 2 * time.Hour
	for _, skew := range []time.Duration{-30 * time.Minute, 0, 30 * time.Minute, 59 * time.Minute} {
		t.Run(skew.String(), func(t *testing.T) {
			t.Parallel()
			e := horizonEnv(t, horizon, time.Hour)
			ctx := context.Background()
			rec := &recorder{}
			h := e.mw(e.pool, func(c *inbox.Config) {
				c.Recorder = rec
				// The consumer's clock is wrong too: it is not consulted.
				c.Now = func() time.Time { return time.Now().Add(-3 * time.Hour) }
			})(func(msg *message.Message) ([]*message.Message, error) {
				return nil, writeEffect(msg, "E")
			})
			p, err := processedstore.NewPurger(e.store, sqldb.PgxPool(e.pool), processedstore.PurgerConfig{}, nil)
			require.NoError(t, err)

			id := uuidV7At(time.Now().Add(skew)) // the producer's clock
			_, err = h(newMsg(id.String()))
			require.NoError(t, err)
			require.Equal(t, 1, rec.Count(inbox.OutcomeProcessed))

			expired := false
			for _, step := range []time.Duration{time.Hour, 61 * time.Minute, 30 * time.Minute, 30 * time.Minute, 10 * time.Hour} {
				id = e.advance(id, step)
				_, _, err := p.PurgeNow(ctx)
				require.NoError(t, err)
				rowKept := e.processed(id.String()) == 1
				_, err = h(newMsg(id.String())) // the redelivery
				if rowKept {
					require.NoError(t, err, "the row is there: a duplicate")
				} else {
					require.ErrorIs(t, err, inbox.ErrExpired, "the row is gone: the claim must refuse")
					require.ErrorIs(t, err, processedstore.ErrExpired)
					require.True(t, inbox.IsPermanent(err))
					expired = true
				}
				require.Equal(t, 1, e.effectsNoted("E"), "applied once, after %s", step)
			}
			require.True(t, expired, "the event ends up expired")
			require.Equal(t, 1, rec.Count(inbox.OutcomeProcessed))
		})
	}
}

// An event dated further ahead of the database clock than MaxFutureSkew
// (default 5 min) is refused by the claim, permanently, logged at ERROR and
// counted as OutcomeFuture, on every beginner; one just inside is applied.
// Before, an event dated 10 years ahead was accepted and never expired.
func TestFutureEventIsRefusedLoudly(t *testing.T) {
	t.Parallel()
	e := horizonEnv(t, 2*time.Hour, 0)
	require.Equal(t, processedstore.DefaultMaxFutureSkew, e.store.MaxFutureSkew())
	db, err := sql.Open("pgx", testenv.SchemaURL(e.schema))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	beginners := map[string]inbox.TxBeginner{
		"pgx":          mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		"pgx_unpiped":  mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{DisablePipeline: true})),
		"database/sql": mustBeginner(inbox.NewStdBeginner(db)),
	}
	for name, b := range beginners {
		rec := &recorder{}
		log := &captureLogger{}
		m, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: e.store, Consumer: "stock", Recorder: rec}, log)
		require.NoError(t, err)
		var calls atomic.Int32
		h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, nil
		})
		for _, ahead := range []time.Duration{10 * 365 * 24 * time.Hour, 10 * time.Minute} {
			id := uuidV7At(time.Now().Add(ahead))
			_, err = h(newMsg(id.String()))
			require.ErrorIs(t, err, inbox.ErrFuture, name)
			require.ErrorIs(t, err, processedstore.ErrFuture, name)
			require.True(t, inbox.IsPermanent(err), name)
			require.Zero(t, e.processed(id.String()), name)
		}
		// Not a UUIDv7: the time comes from occurred_at.
		v4 := newMsg(uuid.NewString())
		v4.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano))
		_, err = h(v4)
		require.ErrorIs(t, err, inbox.ErrFuture, name)
		require.Zero(t, calls.Load(), name)
		require.Equal(t, 3, rec.Count(inbox.OutcomeFuture), name)
		errors := 0
		for _, l := range log.lines {
			if l.level == "error" {
				errors++
			}
		}
		require.Equal(t, 3, errors, "%s: each refusal is logged at ERROR", name)

		_, err = h(newMsg(uuidV7At(time.Now().Add(time.Minute)).String()))
		require.NoError(t, err, name)
		require.EqualValues(t, 1, calls.Load(), name)
	}
}

// Without a UUIDv7 the claim dates the event by occurred_at; without either
// it dates it now() and never refuses it.
func TestExpiryFallsBackToOccurredAt(t *testing.T) {
	t.Parallel()
	e := horizonEnv(t, time.Hour, 0)
	h := e.mw(e.pool, nil)(func(msg *message.Message) ([]*message.Message, error) {
		return nil, nil
	})
	old := newMsg(uuid.NewString()) // v4: no time inside
	old.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().Add(-2*time.Hour).UTC().Format(time.RFC3339Nano))
	_, err := h(old)
	require.ErrorIs(t, err, inbox.ErrExpired)
	fresh := newMsg(uuid.NewString())
	fresh.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano))
	_, err = h(fresh)
	require.NoError(t, err)
	_, err = h(newMsg(uuidV7At(time.Now().Add(-2 * time.Hour)).String()))
	require.ErrorIs(t, err, inbox.ErrExpired)
	_, err = h(newMsg(uuid.NewString()))
	require.NoError(t, err, "no time at all: let through, dated now()")
	require.Equal(t, 2, e.count(`SELECT count(*) FROM processed_event`))
}

// A duplicate of a row whose event has expired since is still a duplicate
// (acked), not a refusal.
func TestDuplicateOfExpiredRowIsDuplicate(t *testing.T) {
	t.Parallel()
	e := horizonEnv(t, time.Hour, 0)
	rec := &recorder{}
	h := e.mw(e.pool, func(c *inbox.Config) { c.Recorder = rec })(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeEffect(msg, "D")
	})
	id := uuidV7At(time.Now())
	_, err := h(newMsg(id.String()))
	require.NoError(t, err)
	id = e.advance(id, 2*time.Hour) // not purged yet
	_, err = h(newMsg(id.String()))
	require.NoError(t, err)
	require.Equal(t, 1, rec.Count(inbox.OutcomeDuplicate))
	require.Equal(t, 1, e.effectsNoted("D"))
}

// The horizon is configured once, on the store; a deprecated ReplayHorizon
// that disagrees with it is refused at construction.
func TestReplayHorizonMustMatchStore(t *testing.T) {
	t.Parallel()
	e := horizonEnv(t, time.Hour, 0)
	b := mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{}))
	_, err := inbox.NewIdempotent(inbox.Config{Beginner: b, Store: e.store, Consumer: "c", ReplayHorizon: 2 * time.Hour}, nil)
	require.ErrorContains(t, err, "Config.ReplayHorizon")
	_, err = inbox.NewIdempotent(inbox.Config{Beginner: b, Store: e.store, Consumer: "c", ReplayHorizon: time.Hour}, nil)
	require.NoError(t, err)
	none, err := processedstore.NewStore(processedstore.Config{})
	require.NoError(t, err)
	_, err = inbox.NewIdempotent(inbox.Config{Beginner: b, Store: none, Consumer: "c", ReplayHorizon: time.Hour}, nil)
	require.ErrorContains(t, err, "processedstore.Config.Horizon")
}
