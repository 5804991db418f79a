package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// skewed returns an outbox on b's table whose process clock is off by d:
// another relay or producer process on a machine with a wrong clock.
func skewed(t *testing.T, b *box, d time.Duration, logger watermill.LoggerAdapter) *outbox.Outbox {
	t.Helper()
	ob, err := outbox.New(outbox.Config{Table: b.table, DB: b.tg.Handle()}, logger)
	require.NoError(t, err)
	outbox.SetProcessClock(ob, func() time.Time { return time.Now().Add(d) })
	return ob
}

// TestClockSkew: relays and producers in several processes compare times
// stored in the outbox (retry schedule, write time); a process whose clock
// is an hour off must not starve or hot-loop the others, nor make the
// age of the oldest pending row wrong. The test process's clock is the
// database's (same machine): the reference.
func TestClockSkew(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		t.Run("RetryOfAheadRelayNotStarved", func(t *testing.T) { testAheadRelayRetry(t, newBox(t, tg)) })
		for _, d := range []time.Duration{time.Hour, -time.Hour} {
			t.Run("BackoffInDatabaseTime/"+d.String(), func(t *testing.T) { testBackoffDBTime(t, newBox(t, tg), d) })
			t.Run("OldestAge/relay"+d.String(), func(t *testing.T) { testAgeSkewedRelay(t, newBox(t, tg), d) })
		}
		t.Run("ProducerBehindReplayAndAge", func(t *testing.T) { testSkewedProducer(t, newBox(t, tg)) })
	})
}

// A relay whose clock is 1 h ahead fails a row once (broker refused it)
// and stops; a relay with a right clock takes over and retries the row
// after its backoff, not an hour later.
func testAheadRelayRetry(t *testing.T, b *box) {
	x := newID()
	b.write(t, "events", x)
	var down atomic.Bool
	down.Store(true)
	s := &sink{refuse: func(topic string, m *message.Message) error {
		if down.Load() && topic == "events" {
			return errors.New("broker: refused")
		}
		return nil
	}}
	ahead := &box{table: b.table, tg: b.tg, ob: skewed(t, b, time.Hour, nil), db: b.db}
	rec := &counts{}
	ra, err := ahead.ob.NewRelay(s, outbox.RelayConfig{PollInterval: 5 * time.Millisecond, RetryInterval: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, MaxAttempts: 1000, Recorder: rec})
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- ra.Run(context.Background()) }()
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 1 && b.nextTry(t) != 0 }, "the ahead relay failed the row (committed)")
	require.NoError(t, ra.Close())
	require.NoError(t, <-done)
	down.Store(false)
	b.relay(t, s, outbox.RelayConfig{RetryInterval: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	eventually(t, 30*time.Second, func() bool { return s.count(x) == 1 }, "the right-clock relay retries the row after its backoff")
}

// nextTry reads the row's next_try_us.
func (b *box) nextTry(t *testing.T) int64 {
	t.Helper()
	var us sql.NullInt64
	require.NoError(t, b.tg.DB.QueryRow(context.Background(), `SELECT max(next_try_us) FROM `+b.tg.Quote(b.table)).Scan(&us))
	return us.Int64
}

// A relay with a skewed clock schedules a failed row's retry at database
// time + backoff: not an hour late (others starve it) nor an hour early
// (every relay hot-loops on it).
func testBackoffDBTime(t *testing.T, b *box, skew time.Duration) {
	b.write(t, "events", newID())
	s := &sink{refuse: refuseRows(errors.New("broker: refused"))}
	sk := &box{table: b.table, tg: b.tg, ob: skewed(t, b, skew, nil), db: b.db}
	rec := &counts{}
	sk.relay(t, s, outbox.RelayConfig{RetryInterval: time.Minute, MaxBackoff: time.Minute, MaxAttempts: 1000, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 1 && b.nextTry(t) != 0 }, "a failed attempt recorded")
	next := time.UnixMicro(b.nextTry(t))
	require.WithinRange(t, next, time.Now().Add(30*time.Second), time.Now().Add(2*time.Minute),
		"retry at database time + 1 min backoff (relay clock %s off)", skew)
}

// A relay whose clock is off reports the oldest pending row's age by the
// database's clock: not 0 (clock behind) nor an hour (clock ahead, and no
// stall warning for a row a second old).
func testAgeSkewedRelay(t *testing.T, b *box, skew time.Duration) {
	b.write(t, "events", newID())
	logger := newTestLogger()
	sk := &box{table: b.table, tg: b.tg, ob: skewed(t, b, skew, logger), db: b.db}
	rec := &counts{}
	s := &sink{refuse: refuseRows(errors.New("broker: refused"))}
	sk.relay(t, s, outbox.RelayConfig{StatsInterval: 5 * time.Millisecond, StalledAfter: 10 * time.Minute, RetryInterval: time.Hour, MaxBackoff: time.Hour, MaxAttempts: 1000, Recorder: rec})
	var last time.Duration
	eventually(t, 30*time.Second, func() bool {
		last = time.Duration(rec.oldest.Load())
		return rec.pending.Load() == 1 && last > 0 && last < 10*time.Minute
	}, "oldest age by the database clock (relay clock "+skew.String()+" off)")
	for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
		require.NotErrorIs(t, e.Err, outbox.ErrStalled, "no stall warning for a fresh row (age %s)", last)
	}
}

// A producer whose clock is an hour behind writes a row: its write time is
// the database's, so a right-clock relay reports a small age and Replay
// finds it in the range of real times it was written in.
func testSkewedProducer(t *testing.T, b *box) {
	t0 := time.Now().Add(-time.Second)
	behind := &box{table: b.table, tg: b.tg, ob: skewed(t, b, -time.Hour, nil), db: b.db}
	x := newID()
	behind.write(t, "events", x)
	t1 := time.Now().Add(time.Second)
	rec := &counts{}
	s := &sink{}
	b.relay(t, s, outbox.RelayConfig{Retention: time.Hour, StatsInterval: 5 * time.Millisecond, Recorder: rec})
	eventually(t, 30*time.Second, func() bool { return s.count(x) == 1 }, "relayed")
	n, err := b.ob.Replay(context.Background(), b.db, nil, outbox.ReplayFilter{From: t0, To: t1, DryRun: true})
	require.NoError(t, err)
	require.Equal(t, 1, n, "the row's write time is the database's: inside [t0, t1)")
}

// TestSessionTimeZone: stored and compared times do not depend on the
// session's time zone (PostgreSQL TimeZone, MySQL time_zone) nor the
// process's: a producer and relay whose sessions run at +13:00 (MariaDB's largest offset), Pacific/Chatham (+13:45) or America/St_Johns (-03:30) store write
// write times in real (UTC) time, schedule retries at now + backoff, and
// report the right age.
func TestSessionTimeZone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, name := range []string{testenv.TargetPostgresPgx, testenv.TargetPostgresStdlib, testenv.TargetMariaDB} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			base := testenv.NewTarget(t, name, 2)
			var db wsql.Beginner
			switch name {
			case testenv.TargetPostgresPgx:
				cfg := testenv.PoolConfig(t, testenv.PostgresURL(), base.Database, 4)
				cfg.ConnConfig.RuntimeParams["timezone"] = "Pacific/Chatham"
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				db = wsql.BeginnerFromPgx(pool)
			case testenv.TargetPostgresStdlib:
				std, err := sql.Open("pgx", testenv.SchemaURL(base.Database)+"&timezone=America/St_Johns")
				require.NoError(t, err)
				t.Cleanup(func() { _ = std.Close() })
				db = wsql.BeginnerFromStdSQL(std)
			case testenv.TargetMariaDB:
				std, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(base.Database)+"&time_zone="+url.QueryEscape("'+13:00'"))
				require.NoError(t, err)
				t.Cleanup(func() { _ = std.Close() })
				db = wsql.BeginnerFromStdSQL(std)
			}
			b := newBox(t, base)
			b.db = db
			t0 := time.Now().Add(-time.Second)
			x := newID()
			b.write(t, "events", x)
			t1 := time.Now().Add(time.Second)
			var created int64
			require.NoError(t, base.DB.QueryRow(ctx, `SELECT created_at_us FROM `+base.Quote(b.table)).Scan(&created))
			require.WithinRange(t, time.UnixMicro(created), t0, t1, "write time in real (UTC) time")
			rec := &counts{}
			s := &sink{refuse: refuseRows(errors.New("broker: refused"))}
			b.relay(t, s, outbox.RelayConfig{StatsInterval: 5 * time.Millisecond, RetryInterval: time.Minute, MaxBackoff: time.Minute, MaxAttempts: 1000, Recorder: rec})
			eventually(t, 30*time.Second, func() bool {
				d := time.Duration(rec.oldest.Load())
				return rec.pending.Load() == 1 && d > 0 && d < 5*time.Minute
			}, "oldest age right whatever the session time zone")
			eventually(t, 30*time.Second, func() bool { return rec.failed.Load() >= 1 && b.nextTry(t) != 0 }, "a failed attempt recorded")
			require.WithinRange(t, time.UnixMicro(b.nextTry(t)), time.Now().Add(30*time.Second), time.Now().Add(2*time.Minute), "retry at now + 1 min")
		})
	}
}

// refuseRows refuses every row with err while the broker takes the probe:
// the failures are the rows' own (an attempt counts, the retry is
// scheduled), not an outage.
func refuseRows(err error) func(string, *message.Message) error {
	return func(topic string, _ *message.Message) error {
		if topic == outbox.DefaultProbeTopic {
			return nil
		}
		return err
	}
}

// On SQLite the outbox's clock is the process clock in microseconds (the
// database is in-process): over 200 writes, the stored write time is never
// earlier than a Go clock read just before the write, nor later than one
// read just after, and it has microsecond resolution. SQLite's
// julianday('now') (milliseconds) read earlier in 199 of 200.
func TestSQLiteClockIsTheProcessClock(t *testing.T) {
	t.Parallel()
	b := newBox(t, testenv.NewTarget(t, testenv.TargetSQLite, 2))
	ctx := context.Background()
	subMillisecond := 0
	for i := 0; i < 200; i++ {
		id := newID()
		before := time.Now()
		b.write(t, "events", id)
		after := time.Now()
		var created int64
		require.NoError(t, b.tg.DB.QueryRow(ctx, `SELECT created_at_us FROM `+b.tg.Quote(b.table)+` WHERE event_id = ?`, id).Scan(&created))
		require.GreaterOrEqual(t, created, before.UnixMicro(), "write %d: stored before the Go clock read just before it", i)
		require.LessOrEqual(t, created, after.UnixMicro(), "write %d: stored after the Go clock read just after it", i)
		if created%1000 != 0 {
			subMillisecond++
		}
	}
	require.Greater(t, subMillisecond, 100, "microsecond resolution")
}
