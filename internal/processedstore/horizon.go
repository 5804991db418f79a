package processedstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// HorizonChangeGrace is how long after a change of a table's replay horizon
// the purge keeps the longer of the old and the new value: consumers verify
// the horizon when they start, so one still running with the old, longer
// horizon must be restarted within it.
const HorizonChangeGrace = 24 * time.Hour

// ErrHorizonMismatch is returned when a consumer is configured with another
// replay horizon than its table keeps.
var ErrHorizonMismatch = errors.New("processed: replay horizon differs from the one the table keeps")

// horizonTable is the quoted name of the table's horizon row table,
// <name>_horizon in the table's schema.
func (s *Store) horizonTable() string {
	q := string(s.dialect.QuoteChar())
	name := q + s.table.Name() + "_horizon" + q
	if schema, _, ok := strings.Cut(s.table.String(), "."); ok {
		return q + schema + q + "." + name
	}
	return name
}

func (s *Store) ph(n int) string {
	if s.dialect == sqldb.PostgreSQL {
		return fmt.Sprintf("$%d", n)
	}
	return "?"
}

// TableHorizon reads the horizon the table keeps: the current value, the
// previous one and when it changed. ok is false when none is recorded.
func (s *Store) TableHorizon(ctx context.Context, q sqldb.Querier) (cur, prev time.Duration, changed time.Time, ok bool, err error) {
	return s.tableHorizon(ctx, q, "")
}

func (s *Store) tableHorizon(ctx context.Context, q sqldb.Querier, lock string) (cur, prev time.Duration, changed time.Time, ok bool, err error) {
	var c, p, at int64
	err = q.QueryRow(ctx, "SELECT horizon_us, previous_us, changed_us FROM "+s.horizonTable()+" WHERE id = 1"+lock).Scan(&c, &p, &at)
	if errors.Is(err, sqldb.ErrNoRows) {
		return 0, 0, time.Time{}, false, nil
	}
	if err != nil {
		return 0, 0, time.Time{}, false, fmt.Errorf("processed: read the replay horizon of %s: %w", s.table, err)
	}
	return time.Duration(c) * time.Microsecond, time.Duration(p) * time.Microsecond, time.UnixMicro(at), true, nil
}

// PurgeHorizon is the horizon a purge at now uses: the table's, or the
// longer of the previous and the current one within HorizonChangeGrace of
// a change. ok is false when the table keeps none (or 0): nothing may be
// purged; and within HorizonChangeGrace of a horizon recorded on a table
// that kept none (previous 0): a consumer started then (ReplayHorizon 0)
// refuses nothing until restarted, as if its horizon were infinite.
func (s *Store) PurgeHorizon(ctx context.Context, q sqldb.Querier, now time.Time) (time.Duration, bool, error) {
	return s.purgeHorizon(ctx, q, now, "")
}

// purgeHorizonForUpdate is PurgeHorizon read by a purge after it wrote its
// mark: on PostgreSQL it holds the horizon's row (FOR SHARE) until the
// transaction ends, so a change of the horizon waits for the batch (its
// mark and its deletes) to commit.
func (s *Store) purgeHorizonForUpdate(ctx context.Context, q sqldb.Querier, now time.Time) (time.Duration, bool, error) {
	lock := ""
	if s.dialect == sqldb.PostgreSQL {
		lock = " FOR SHARE"
	}
	return s.purgeHorizon(ctx, q, now, lock)
}

func (s *Store) purgeHorizon(ctx context.Context, q sqldb.Querier, now time.Time, lock string) (time.Duration, bool, error) {
	cur, prev, changed, ok, err := s.tableHorizon(ctx, q, lock)
	if err != nil || !ok || cur == 0 {
		// None, or changed to none: consumers started since refuse
		// nothing, so nothing is purged, grace or not.
		return 0, false, err
	}
	if now.Sub(changed) < HorizonChangeGrace {
		if prev == 0 {
			return 0, false, nil
		}
		if prev > cur {
			cur = prev
		}
	}
	return cur, cur > 0, nil
}

// insertHorizon is the statement that records a horizon ($1), previous
// ($2) and change time ($3) on a table with no horizon row; it does
// nothing (0 rows) when the row exists.
func (s *Store) insertHorizon() string {
	insert := "INSERT INTO " + s.horizonTable() + " (id, horizon_us, previous_us, changed_us) VALUES (1, " +
		s.ph(1) + ", " + s.ph(2) + ", " + s.ph(3) + ")"
	if s.dialect == sqldb.MySQL {
		return strings.Replace(insert, "INSERT INTO", "INSERT IGNORE INTO", 1)
	}
	return insert + " ON CONFLICT (id) DO NOTHING"
}

// AdoptHorizon returns the horizon the table keeps (0: none), recording d
// when d > 0 and the table keeps none. With d > 0 a different recorded
// horizon is ErrHorizonMismatch; d == 0 adopts the recorded one and
// records none: on a table that keeps none it returns 0 (the claim
// refuses nothing) and leaves the table keeping none, writing a row of 0
// when there is no row, so that a later recording knows a consumer may
// run without a replay window. A horizon recorded over a row of 0 keeps
// previous 0, and PurgeHorizon purges nothing for HorizonChangeGrace; one
// recorded on a table with no row (no consumer started on it) is used at
// once. The horizon returned is the claim's window: narrower than the
// table's while rows a shorter horizon purged are younger than it (the
// horizon was widened, or set to none, after a purge: purgedWindow); keeps
// is the table's own horizon, read in the same call (0: none).
func (s *Store) AdoptHorizon(ctx context.Context, q sqldb.Querier, d time.Duration, now time.Time) (window, keeps time.Duration, err error) {
	us := d.Microseconds()
	if _, err := q.Exec(ctx, s.insertHorizon(), us, us, now.UnixMicro()); err != nil {
		return 0, 0, fmt.Errorf("processed: record the replay horizon of %s (run processed.Migrate): %w", s.table, err)
	}
	cur, _, _, _, err := s.TableHorizon(ctx, q)
	if err != nil {
		return 0, 0, err
	}
	if d > 0 && cur == 0 {
		// The table keeps none: record d, from none. Of two consumers
		// recording at once one wins, the other is compared with it.
		_, err := q.Exec(ctx, "UPDATE "+s.horizonTable()+" SET horizon_us = "+s.ph(1)+", previous_us = 0, changed_us = "+
			s.ph(2)+" WHERE id = 1 AND horizon_us = 0", us, now.UnixMicro())
		if err != nil {
			return 0, 0, fmt.Errorf("processed: record the replay horizon of %s: %w", s.table, err)
		}
		if cur, _, _, _, err = s.TableHorizon(ctx, q); err != nil {
			return 0, 0, err
		}
	}
	if d > 0 && cur != d {
		return cur, cur, fmt.Errorf("%w: table %s keeps %s, configured %s: every consumer and purger of a table shares "+
			"one horizon; change it with processed.SetReplayHorizon, then restart the consumers with the new value",
			ErrHorizonMismatch, s.table, cur, d)
	}
	window, err = s.purgedWindow(ctx, q, cur)
	return window, cur, err
}

// SetHorizon changes the table's horizon to d (≥ 0), keeping the previous
// value for the purge's grace (HorizonChangeGrace; from 0, none, the purge
// waits it out). Within the grace of an earlier change the previous value
// kept is the longest in force since that change (0, none, is the
// longest), so consumers started before it stay covered for the new
// change's grace; d equal to the table's horizon changes nothing (nor
// restarts the grace). On a table with no horizon row it records d at
// once.
func (s *Store) SetHorizon(ctx context.Context, q sqldb.Querier, d time.Duration, now time.Time) error {
	if d < 0 {
		return fmt.Errorf("processed: replay horizon %s: must be ≥ 0", d)
	}
	us := d.Microseconds()
	n, err := q.Exec(ctx, s.insertHorizon(), us, us, now.UnixMicro())
	if err != nil {
		return fmt.Errorf("processed: record the replay horizon of %s (run processed.Migrate): %w", s.table, err)
	}
	if n == 1 {
		return nil
	}
	// previous_us first: MySQL assigns left to right, each assignment
	// seeing the columns set before it.
	_, err = q.Exec(ctx, "UPDATE "+s.horizonTable()+" SET previous_us = CASE WHEN changed_us > "+s.ph(1)+
		" THEN CASE WHEN previous_us = 0 OR horizon_us = 0 THEN 0 WHEN previous_us > horizon_us THEN previous_us"+
		" ELSE horizon_us END ELSE horizon_us END, horizon_us = "+s.ph(2)+", changed_us = "+s.ph(3)+
		" WHERE id = 1 AND horizon_us <> "+s.ph(4), now.Add(-HorizonChangeGrace).UnixMicro(), us, now.UnixMicro(), us)
	if err != nil {
		return fmt.Errorf("processed: set the replay horizon of %s: %w", s.table, err)
	}
	return nil
}

// SharedHandlerWindow is how far back NoteHandler looks for another
// handler of the same consumer name.
const SharedHandlerWindow = 24 * time.Hour

// NoteHandler records that consumer serves handler (now), and returns the
// other handler names recorded for consumer within SharedHandlerWindow.
func (s *Store) NoteHandler(ctx context.Context, q sqldb.Querier, consumer, handler string, now time.Time) ([]string, error) {
	q2 := string(s.dialect.QuoteChar())
	table := q2 + s.table.Name() + "_handler" + q2
	if schema, _, ok := strings.Cut(s.table.String(), "."); ok {
		table = q2 + schema + q2 + "." + table
	}
	upsert := "INSERT INTO " + table + " (consumer, handler, seen_us) VALUES (" + s.ph(1) + ", " + s.ph(2) + ", " + s.ph(3) + ")"
	if s.dialect == sqldb.MySQL {
		upsert += " ON DUPLICATE KEY UPDATE seen_us = VALUES(seen_us)"
	} else {
		upsert += " ON CONFLICT (consumer, handler) DO UPDATE SET seen_us = excluded.seen_us"
	}
	if _, err := q.Exec(ctx, upsert, consumer, handler, now.UnixMicro()); err != nil {
		return nil, fmt.Errorf("processed: record handler %q of consumer %q: %w", handler, consumer, err)
	}
	// One other name is enough to report; the read is bounded to a few.
	var others []string
	for i := 0; i < 3; i++ {
		var name string
		err := q.QueryRow(ctx, "SELECT handler FROM "+table+" WHERE consumer = "+s.ph(1)+" AND handler <> "+s.ph(2)+
			" AND seen_us > "+s.ph(3)+" ORDER BY handler LIMIT 1 OFFSET "+fmt.Sprint(i),
			consumer, handler, now.Add(-SharedHandlerWindow).UnixMicro()).Scan(&name)
		if errors.Is(err, sqldb.ErrNoRows) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("processed: read handlers of consumer %q: %w", consumer, err)
		}
		others = append(others, name)
	}
	return others, nil
}

func (s *Store) sideTable(suffix string) string {
	q := string(s.dialect.QuoteChar())
	name := q + s.table.Name() + suffix + q
	if schema, _, ok := strings.Cut(s.table.String(), "."); ok {
		return q + schema + q + "." + name
	}
	return name
}

// CheckCrashTable reads nothing from the table's crash count table
// (<table>_crash, processed migration 0006; 0004 of the partitioned
// layout) and returns an error naming it, and the migration, when it
// cannot be read: a consumer with a crash bound would count no attempt.
func (s *Store) CheckCrashTable(ctx context.Context, q sqldb.Querier) error {
	t := s.sideTable("_crash")
	var one int
	err := q.QueryRow(ctx, "SELECT 1 FROM "+t+" WHERE 1 = 0").Scan(&one)
	if err == nil || errors.Is(err, sqldb.ErrNoRows) {
		return nil
	}
	return fmt.Errorf("processed: the crash count table %s cannot be read (run processed.Migrate: migration 0006 creates it): %w", t, err)
}

// StartAttempt counts, in autocommit on q, one more started attempt of
// (consumer, eventID) and returns the count, this one included.
func (s *Store) StartAttempt(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (int, error) {
	t := s.sideTable("_crash")
	id := s.sql.eventID(eventID)
	if s.dialect == sqldb.MySQL {
		if _, err := q.Exec(ctx, "INSERT INTO "+t+" (consumer, event_id, started) VALUES (?, ?, 1) ON DUPLICATE KEY UPDATE started = started + 1", consumer, id); err != nil {
			return 0, err
		}
		var n int
		err := q.QueryRow(ctx, "SELECT started FROM "+t+" WHERE consumer = ? AND event_id = ?", consumer, id).Scan(&n)
		return n, err
	}
	var n int
	err := q.QueryRow(ctx, "INSERT INTO "+t+" (consumer, event_id, started) VALUES ("+s.ph(1)+", "+s.ph(2)+", 1) "+
		"ON CONFLICT (consumer, event_id) DO UPDATE SET started = "+t+".started + 1 RETURNING started", consumer, id).Scan(&n)
	return n, err
}

// StartAttemptUnlessProcessed is StartAttempt for an event that may already
// be processed: when (consumer, eventID) has a row in the table, nothing is
// counted and its stored identity is returned (Found): a redelivered
// duplicate costs one read-only statement, the duplicate path's read
// (StoredIdentity), instead of a counted attempt, a claim and the count's
// end. An event not processed yet is then counted (StartAttempt); if
// another consumer processes it in between, its claim finds the row and
// the attempt's end takes its start off. A processed attempt deletes its
// count in its own transaction (ForgetAttempts on it; inside
// watermill-sql's subscriber transaction, after it). A count an earlier
// release left behind (its end ran after the commit) stays, never read
// while the event's row exists; a redelivery after the row was purged is
// claimed before it could be taken for a crash loop, and the claim refuses
// it as expired. Reading only costs the server 55k instructions where one
// statement counting and deleting in CTEs cost 140k (issue 25). started is
// 0 when Found. sent reports that StartAttempt was sent: only then may an
// error hide a start that was written (its answer lost), whose end is
// owed; a failed read wrote nothing.
func (s *Store) StartAttemptUnlessProcessed(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) (started int, stored StoredIdentity, sent bool, err error) {
	if stored, err = s.StoredIdentity(ctx, q, consumer, eventID); err != nil || stored.Found {
		return 0, stored, false, err
	}
	started, err = s.StartAttempt(ctx, q, consumer, eventID)
	return started, StoredIdentity{}, true, err
}

// EndAttempt counts one started attempt of (consumer, eventID) as ended
// (failed, refused, or found a duplicate), in autocommit on q: the count
// goes down by one, and a count at zero is deleted. Only this attempt's
// start goes: another copy of the event that failed beside an attempt
// that hangs (a redelivery after the ack deadline, whose claim waits for
// the hung one's) leaves the hung attempt's start counted, so a liveness
// probe killing it again and again ends in a crash loop.
func (s *Store) EndAttempt(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) error {
	t, id := s.sideTable("_crash"), s.sql.eventID(eventID)
	where := " WHERE consumer = " + s.ph(1) + " AND event_id = " + s.ph(2)
	if _, err := q.Exec(ctx, "UPDATE "+t+" SET started = started - 1"+where+" AND started > 0", consumer, id); err != nil {
		return err
	}
	_, err := q.Exec(ctx, "DELETE FROM "+t+where+" AND started <= 0", consumer, id)
	return err
}

// ForgetAttempts deletes the count of (consumer, eventID): the event was
// processed, or dead-lettered as a crash loop (a redrive starts afresh).
// Run on the attempt's own transaction, it commits with the claim and
// leaves no count behind a process that dies after the commit.
func (s *Store) ForgetAttempts(ctx context.Context, q sqldb.Querier, consumer string, eventID uuid.UUID) error {
	_, err := q.Exec(ctx, "DELETE FROM "+s.sideTable("_crash")+" WHERE consumer = "+s.ph(1)+" AND event_id = "+s.ph(2),
		consumer, s.sql.eventID(eventID))
	return err
}

// purgeMarkID is the horizon table's row (beside row 1, the horizon) that
// records how far the table may have been purged: its horizon_us is a time,
// Unix microseconds on the clock the purge and the claim use (the
// database's; SQLite's is the process's), before which rows may be gone.
// Every purge raises it before it deletes (notePurge); a consumer starting
// reads it (purgedWindow). Older releases read and write row 1 only.
const purgeMarkID = 2

// purgeClaimSlack is how much longer than its horizon the Purger keeps a
// row: it deletes rows dated before now() − horizon − purgeClaimSlack
// (PurgeBatch with the horizon plus it), and drops partitions wholly
// older than that. A claim judges its window by
// the time its statement started (on PostgreSQL its transaction's start:
// a watermill-sql subscriber's batch transaction may be old), then may
// wait for a row the purge is deleting, and inserts when that row is gone:
// without the slack an event dated between the claim's cutoff and the
// purge's later one had its row purged and was claimed, and applied, a
// second time. A claim whose window check ran more than this before the
// purge deleted its row is the residue (a transaction open that long).
const purgeClaimSlack = 5 * time.Minute

// purgeMarkSlack is added to the mark: the purge's statements run after the
// mark is written (on MySQL and SQLite in their own transactions, behind a
// pooler's queue at worst), and their clock moves meanwhile. A consumer
// started after a widening refuses events this much newer than needed.
const purgeMarkSlack = 5 * time.Minute

// nowMicrosSQL is the database clock as Unix microseconds, the basis of
// the mark; "" on SQLite, where the process clock is used.
func (s *Store) nowMicrosSQL() string {
	switch s.dialect {
	case sqldb.PostgreSQL:
		return "(extract(epoch from now()) * 1000000)::bigint"
	case sqldb.MySQL:
		return "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
	}
	return ""
}

// notePurge raises the purge mark to now − h + purgeMarkSlack before a purge
// at horizon h deletes or drops anything: rows dated before it may be gone.
func (s *Store) notePurge(ctx context.Context, q sqldb.Querier, h time.Duration) error {
	t := s.horizonTable()
	var stmt string
	var arg int64
	switch s.dialect {
	case sqldb.PostgreSQL:
		stmt = "INSERT INTO " + t + " (id, horizon_us, previous_us, changed_us) VALUES (2, " + s.nowMicrosSQL() + " - $1, 0, 0) " +
			"ON CONFLICT (id) DO UPDATE SET horizon_us = greatest(" + t + ".horizon_us, excluded.horizon_us)"
		arg = (h - purgeMarkSlack).Microseconds()
	case sqldb.MySQL:
		stmt = "INSERT INTO " + t + " (id, horizon_us, previous_us, changed_us) VALUES (2, " + s.nowMicrosSQL() + " - ?, 0, 0) " +
			"ON DUPLICATE KEY UPDATE horizon_us = GREATEST(horizon_us, VALUES(horizon_us))"
		arg = (h - purgeMarkSlack).Microseconds()
	default:
		stmt = "INSERT INTO " + t + " (id, horizon_us, previous_us, changed_us) VALUES (2, ?, 0, 0) " +
			"ON CONFLICT (id) DO UPDATE SET horizon_us = max(horizon_us, excluded.horizon_us)"
		arg = time.Now().Add(purgeMarkSlack - h).UnixMicro()
	}
	if _, err := q.Exec(ctx, stmt, arg); err != nil {
		return fmt.Errorf("processed: record how far %s is purged: %w", s.table, err)
	}
	return nil
}

// purgedWindow is the window a consumer starting now may accept without
// a gap, for cur, the table's horizon (0: none): cur, unless the table was
// purged further than cur allows (the horizon was widened, or set to none,
// after a purge by a shorter one): then the time since the purge mark, so
// a redelivery of an event whose row is gone is refused as expired. It is
// fixed when the consumer starts; one started later, once the purged rows
// are older than cur, gets cur.
func (s *Store) purgedWindow(ctx context.Context, q sqldb.Querier, cur time.Duration) (time.Duration, error) {
	var mark, now int64
	var err error
	if clock := s.nowMicrosSQL(); clock != "" {
		err = q.QueryRow(ctx, "SELECT horizon_us, "+clock+" FROM "+s.horizonTable()+" WHERE id = "+s.ph(1), purgeMarkID).Scan(&mark, &now)
	} else {
		err = q.QueryRow(ctx, "SELECT horizon_us FROM "+s.horizonTable()+" WHERE id = "+s.ph(1), purgeMarkID).Scan(&mark)
		now = time.Now().UnixMicro()
	}
	if errors.Is(err, sqldb.ErrNoRows) {
		return cur, nil // never purged (or only by an older release)
	}
	if err != nil {
		return 0, fmt.Errorf("processed: read how far %s is purged: %w", s.table, err)
	}
	since := max(time.Duration(now-mark)*time.Microsecond, time.Second)
	if cur == 0 || since+purgeMarkSlack < cur {
		return since, nil
	}
	return cur, nil
}
