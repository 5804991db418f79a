package versioned_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

func TestFamilyPurgerConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Pool(t)
	s, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	_, err = versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{}, nil)
	require.ErrorContains(t, err, "FamilyPurgerConfig.Horizon")
	_, err = versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Minute}, nil)
	require.ErrorIs(t, err, versioned.ErrFamilyHorizonTooShort)
	_, err = versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: -1}, nil)
	require.ErrorContains(t, err, "FamilyPurgerConfig.BatchSize")
	_, err = versioned.NewFamilyPurger(nil, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Hour}, nil)
	require.Error(t, err)
	_, err = versioned.NewFamilyPurger(s, idempotency.Pgx(pool), versioned.FamilyPurgerConfig{Horizon: time.Minute, MinHorizon: time.Second}, nil)
	require.NoError(t, err)
}

// idle sets the updated_at of table's rows to the database clock minus
// oldMin minutes for families whose (numeric) id is below split, minus
// youngMin minutes for the others.
func idle(t *testing.T, tg testenv.Target, table string, split, oldMin, youngMin int) {
	t.Helper()
	var query string
	switch tg.Dialect {
	case sqldb.PostgreSQL:
		query = `UPDATE ` + table + ` SET updated_at = now() - CASE WHEN family_id::int < $1 THEN $2::int ELSE $3::int END * interval '1 minute'`
	case sqldb.MySQL:
		query = `UPDATE ` + table + ` SET updated_at = UTC_TIMESTAMP(6) - INTERVAL CASE WHEN CAST(family_id AS UNSIGNED) < ? THEN ? ELSE ? END MINUTE`
	default:
		query = `UPDATE ` + table + ` SET updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || CASE WHEN CAST(family_id AS INTEGER) < ? THEN ? ELSE ? END || ' minutes')`
	}
	_, err := tg.DB.Exec(context.Background(), query, split, oldMin, youngMin)
	require.NoError(t, err)
}

// count returns the number of rows of table.
func count(t *testing.T, tg testenv.Target, table string) int {
	t.Helper()
	var n int
	require.NoError(t, tg.DB.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n))
	return n
}

// Families idle longer than the horizon go, from both tables, in bounded
// batches; active ones stay; the cutoff is the database clock's whatever
// the session time zone.
func TestFamilyPurgeIdle(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		s := migratedFamiliesOn(t, tg)
		for i := 0; i < 7; i++ {
			f := versioned.Family{Kind: "k", ID: fmt.Sprint(i)}
			pos := versioned.SeqPosition(1, uuid.Must(uuid.NewV7()))
			_, err := s.Advance(ctx, tg.DB, f, pos)
			require.NoError(t, err)
			_, err = s.RecordApplied(ctx, tg.DB, "c", f, pos)
			require.NoError(t, err)
		}
		// Families 0-4 idle for 2 hours (both tables), 5 and 6 for 59 minutes.
		idle(t, tg, "family_latest", 5, 120, 59)
		idle(t, tg, "family_applied", 5, 120, 59)
		n, err := s.PurgeBatch(ctx, tg.DB, time.Hour, 3)
		require.NoError(t, err)
		require.EqualValues(t, 3, n, "bounded by the batch size")

		// The purger's sessions run in a time zone far from UTC.
		var pool idempotency.DB
		switch tg.Name {
		case testenv.TargetPostgresPgx:
			cfg := testenv.PoolConfig(t, testenv.PostgresURL(), tg.Database, 4)
			cfg.ConnConfig.RuntimeParams["timezone"] = "Pacific/Kiritimati"
			tzPool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(tzPool.Close)
			pool = idempotency.Pgx(tzPool)
		case testenv.TargetPostgresStdlib:
			db, err := sql.Open("pgx", testenv.SchemaURL(tg.Database)+"&timezone=Pacific/Kiritimati")
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			pool = idempotency.SQL(db, idempotency.PostgreSQL)
		case testenv.TargetMariaDB:
			db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(tg.Database)+"&time_zone=%27-11%3A00%27")
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			pool = idempotency.SQL(db, idempotency.MySQL)
		default: // SQLite has no session time zone; 'now' is UTC
			pool = tg.Handle()
		}
		purger, err := versioned.NewFamilyPurger(s, pool, versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: 2}, nil)
		require.NoError(t, err)
		n, ran, err := purger.PurgeNow(ctx)
		require.NoError(t, err)
		require.True(t, ran)
		require.EqualValues(t, 7, n, "the remaining 2 latest and 5 applied rows, in batches of 2")
		require.Equal(t, 2, count(t, tg, "family_latest"))
		require.Equal(t, 2, count(t, tg, "family_applied"))
	})
}

// Two purgers at once: while one holds the lock, the other skips its run.
func TestFamilyPurgersOneAtATime(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		s := migratedFamiliesOn(t, tg)
		for i := 1; i <= 30; i++ {
			_, err := s.Advance(ctx, tg.DB, versioned.Family{Kind: "k", ID: fmt.Sprint(i)}, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
			require.NoError(t, err)
		}
		idle(t, tg, "family_latest", 100, 120, 120)
		inRun, release := make(chan struct{}), make(chan struct{})
		first, err := versioned.NewFamilyPurger(s, tg.Handle(), versioned.FamilyPurgerConfig{
			Horizon: time.Hour,
			OnPurge: func(int64, time.Time) { close(inRun); <-release },
		}, nil)
		require.NoError(t, err)
		// Another instance: its own handle on the database.
		second, err := versioned.NewFamilyPurger(s, testenv.OpenTarget(t, tg.Name, tg.Database, 2).Handle(), versioned.FamilyPurgerConfig{Horizon: time.Hour}, nil)
		require.NoError(t, err)
		done := make(chan int64, 1)
		go func() {
			n, ran, err := first.PurgeNow(ctx)
			if err != nil || !ran {
				t.Errorf("the first purger: ran %v, %v", ran, err)
			}
			done <- n
		}()
		select {
		case <-inRun:
		case <-done:
			t.Fatal("the first purger did not hold the lock")
		}
		n, ran, err := second.PurgeNow(ctx)
		require.NoError(t, err)
		require.False(t, ran)
		require.Zero(t, n)
		close(release)
		require.EqualValues(t, 30, <-done)
		_, ran, err = second.PurgeNow(ctx)
		require.NoError(t, err)
		require.True(t, ran, "the lock is released after the run")
	})
}

func TestFamilyPurgerStartStop(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		ctx := context.Background()
		s := migratedFamiliesOn(t, tg)
		_, err := s.RecordApplied(ctx, tg.DB, "c", versioned.Family{Kind: "k", ID: "1"}, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
		require.NoError(t, err)
		idle(t, tg, "family_applied", 100, 120, 120)
		runs := make(chan int64, 16)
		p, err := versioned.NewFamilyPurger(s, tg.Handle(), versioned.FamilyPurgerConfig{
			Horizon:  time.Hour,
			Interval: time.Millisecond,
			OnPurge:  func(n int64, _ time.Time) { runs <- n },
		}, nil)
		require.NoError(t, err)
		p.Stop() // without Start: a no-op
		require.NoError(t, p.Start(ctx))
		require.Error(t, p.Start(ctx), "started twice")
		select {
		case n := <-runs:
			require.EqualValues(t, 1, n)
		case <-time.After(30 * time.Second):
			t.Fatal("no purge run")
		}
		p.Stop()
		p.Stop()
		// Stopped: no run is in progress, and none starts any more.
		for len(runs) > 0 {
			<-runs
		}
		require.NoError(t, p.Start(ctx), "can start again after Stop")
		p.Stop()
	})
}

// A family is idle when neither of its rows was written for longer than the
// horizon: a newer message published (the latest record advanced) and
// applied through the filter (the applied record moved) since makes its
// rows young again, so the purger keeps them, on every target and for
// each of the statements that move a record (the producer's advance, the
// filter's verdict, RecordApplied). Left old, the applied row of a family
// in use went, and an older message still queued was applied after it.
func TestFamilyPurgeKeepsRowsMovedWithinTheHorizon(t *testing.T) {
	t.Parallel()
	for _, drv := range testenv.TargetNames {
		t.Run(drv, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newLFEnvWith(t, "postgres", drv)
			fam := versioned.Family{Kind: "customer.status", ID: "1"}
			pub := e.publisher(&lfQueue{})
			h := e.chain("crm", e.stateHandler(func(*message.Message) {}))
			m1, m2 := lfSeqMsg(t, fam, 1), lfSeqMsg(t, fam, 2)
			require.NoError(t, pub.Publish("customer.status", m1))
			require.NoError(t, deliver(h, m1))
			other := versioned.Family{Kind: "customer.status", ID: "2"}
			_, err := e.families.RecordApplied(ctx, e.db, "crm", other, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
			require.NoError(t, err)
			idle(t, e.tg, "family_latest", 100, 120, 120)
			idle(t, e.tg, "family_applied", 100, 120, 120)

			require.NoError(t, pub.Publish("customer.status", m2))
			require.NoError(t, deliver(h, m2))
			_, err = e.families.RecordApplied(ctx, e.db, "crm", other, versioned.SeqPosition(2, uuid.Must(uuid.NewV7())))
			require.NoError(t, err)
			n, err := e.families.PurgeBatch(ctx, e.db, time.Hour, 100)
			require.NoError(t, err)
			require.Zero(t, n, "rows moved a moment ago are not idle")
			require.Equal(t, 1, count(t, e.tg, "family_latest"))
			require.Equal(t, 2, count(t, e.tg, "family_applied"))
		})
	}
}

// The retired table (each consumer's poisoned newest message of a family)
// is purged by the same horizon as the two others: a retired row idle for
// longer goes, a younger one stays, and so does one that moved on to a
// newer poisoned message since. It was never purged and grew by a row
// per family and consumer that ever had a message poisoned.
func TestFamilyPurgeRetiredRows(t *testing.T) {
	t.Parallel()
	for _, drv := range testenv.TargetNames {
		t.Run(drv, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newLFEnvWith(t, "postgres", drv)
			pub := e.publisher(&lfQueue{})
			idem, err := inbox.NewIdempotent(inbox.Config{Beginner: e.beginner, Store: e.processed, Consumer: "crm"}, nil)
			require.NoError(t, err)
			chain, err := inbox.NewChain(inbox.ChainConfig{
				Idempotent: idem, PoisonPublisher: &lfQueue{}, PoisonTopic: "crm.poison",
				MaxRetries: 1, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
			}, nil)
			require.NoError(t, err)
			var h message.HandlerFunc = e.filter("crm").Middleware(func(*message.Message) ([]*message.Message, error) {
				return nil, inbox.Permanent(errors.New("cannot apply"))
			})
			for i := len(chain) - 1; i >= 0; i-- {
				h = chain[i](h)
			}
			poisonSeq := func(id string, seq int64) {
				m := lfSeqMsg(t, versioned.Family{Kind: "customer.status", ID: id}, seq)
				require.NoError(t, pub.Publish("customer.status", m))
				require.NoError(t, deliver(h, m), "poisoned, retired")
			}
			for _, id := range []string{"1", "2", "3"} {
				poisonSeq(id, 1)
			}
			require.Equal(t, 3, count(t, e.tg, "family_applied_retired"))
			// Families 1 and 2 retired 2 hours ago, family 3 59 minutes
			// ago; family 2's retirement then moves on to a newer message.
			idle(t, e.tg, "family_applied_retired", 3, 120, 59)
			poisonSeq("2", 2)
			n, err := e.families.PurgeBatch(ctx, e.db, time.Hour, 100)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
			require.Equal(t, 2, e.count(`SELECT count(*) FROM family_applied_retired WHERE family_id IN ('2', '3')`))
		})
	}
}
