package processedstore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Layout is the physical layout of the processed-event table.
type Layout int

const (
	// LayoutPlain is one table (the default). A table the user partitioned
	// himself (by hash or range, with the primary key kept) also works:
	// the purge keys rows by the primary key.
	LayoutPlain Layout = iota
	// LayoutPartitioned (PostgreSQL 14+) RANGE-partitions the table on
	// event_id by time spans of UUIDv7 ids, created ahead and dropped
	// behind by the Purger, so retention costs O(1) per partition whatever
	// the row count; ids of other versions go to a plain side table
	// "<table>_other" purged by DELETE. See the migration
	// migrations/postgres_partitioned/0001_create_partitioned.up.sql.
	LayoutPartitioned
)

// DefaultPartitionSpan is the default Config.PartitionSpan.
const DefaultPartitionSpan = time.Hour

// partitionAhead is how many spans beyond now() + MaxFutureSkew the purger
// keeps created, so that a stopped purger has that long before claims start
// landing in the default partition.
const partitionAhead = 3

// partitionSuffix is the time format of a partition's name suffix (UTC,
// the start of its span).
const partitionSuffix = "200601021504"

func (c Config) validateLayout() error {
	switch c.Layout {
	case LayoutPlain:
		return nil
	case LayoutPartitioned:
	default:
		return fmt.Errorf("processed: Config.Layout %d: unknown", c.Layout)
	}
	if c.Dialect != sqldb.PostgreSQL {
		return fmt.Errorf("processed: Config.Layout: LayoutPartitioned needs PostgreSQL, not %s", c.Dialect)
	}
	if id, err := sqldb.ParseIdent(c.Table); err == nil && len(id.Name()) > 63-len("_p"+partitionSuffix) {
		return fmt.Errorf("processed: Config.Table %q: at most %d characters with LayoutPartitioned (partition names add a suffix)", c.Table, 63-len("_p"+partitionSuffix))
	}
	if c.PartitionSpan != 0 && (c.PartitionSpan < time.Minute || c.PartitionSpan%time.Minute != 0) {
		return fmt.Errorf("processed: Config.PartitionSpan %s: whole minutes, at least one", c.PartitionSpan)
	}
	return nil
}

// sibling is the quoted identifier of a table next to s.table (same
// schema) named <table>_<suffix>.
func (s *Store) sibling(suffix string) string {
	name := s.table.Name() + "_" + suffix
	if schema, _, ok := strings.Cut(s.table.String(), "."); ok {
		name = schema + "." + name
	}
	id, _ := sqldb.ParseIdent(name)
	return id.Quoted('"')
}

func (s *Store) initPartitioned() {
	other := s.sibling("other")
	s.other = &otherSQL{
		claim:   fmt.Sprintf(postgresSQL.claim, other),
		exists:  fmt.Sprintf(postgresSQL.exists, other),
		verdict: fmt.Sprintf(postgresSQL.verdict, other, s.horizon.Microseconds()),
	}
	if s.horizon > 0 {
		s.other.claim = fmt.Sprintf(postgresSQL.window, other, s.horizon.Microseconds(), s.skew.Microseconds())
	}
	// The DELETE purge of the layout: the default partition and the side
	// table only; the time partitions are dropped whole.
	s.purgeSQL = fmt.Sprintf(`WITH d AS (%s RETURNING 1), o AS (%s RETURNING 1)
SELECT (SELECT count(*) FROM d) + (SELECT count(*) FROM o)`,
		fmt.Sprintf(postgresSQL.purgeBatch, s.sibling("default")), fmt.Sprintf(postgresSQL.purgeBatch, other))
}

// otherSQL is the partitioned layout's statements on the side table.
type otherSQL struct{ claim, exists, verdict string }

// routed reports whether eventID's row lives in the side table.
func (s *Store) routed(eventID uuid.UUID) bool {
	return s.other != nil && eventID.Version() != 7
}

// Layout is Config.Layout.
func (s *Store) Layout() Layout { return s.layout }

// v7Bound is the smallest UUID whose UUIDv7 timestamp is t (milliseconds).
func v7Bound(t time.Time) uuid.UUID {
	var id uuid.UUID
	ms := uint64(t.UnixMilli())
	for i := 5; i >= 0; i-- {
		id[i] = byte(ms)
		ms >>= 8
	}
	return id
}

// PartitionReport is what one MaintainPartitions run did.
type PartitionReport struct {
	Created, Dropped []string // partition names
	// Skipped are partitions it could not create or drop this time (for
	// example rows of that span already sit in the default partition, or
	// the drop's lock wait timed out); the next run tries again.
	Skipped []error
	// Waiting are partitions not created because rows of their range
	// already sit in the default partition (claimed while no purger ran):
	// no error; those rows stay there, DELETE-purged by event_at, and
	// claims of that span keep landing there until the span has passed.
	Waiting []string
}

// ErrPlainTable is returned by Migrate with LayoutPartitioned when the
// table exists and is not partitioned (made by the plain layout): convert
// it with MigrateToPartitioned.
var ErrPlainTable = errors.New("processed: the table exists and is not partitioned (convert it with Store.MigrateToPartitioned)")

// ErrNotPartitioned is returned by MaintainPartitions on a LayoutPlain store.
var ErrNotPartitioned = errors.New("processed: the store's layout is not partitioned")

// MaintainPartitions creates the time partitions of the next spans, up to
// now() + MaxFutureSkew + 3 spans by the database clock, and drops every
// time partition whose whole range is older than now() − purgeHorizon: all
// its rows are then dated before now() − purgeHorizon, so, with
// purgeHorizon ≥ the store's Horizon, the claim refuses every one of their
// redeliveries (a partition is never dropped while a redelivery of one of
// its events could still be accepted).
//
// Both decisions read each partition's own bounds from the catalog
// (pg_class.relpartbound), whatever its name or the span it was made with:
// a span changed between releases, a partition an operator added, or a
// span that divides no hour, never makes a partition go early, and new
// spans are created only over the part of their range no partition holds
// yet (no "would overlap" error run after run). A span whose range already
// has rows in the default partition (claims made while no partition
// existed) is not created (PostgreSQL would refuse, SQLSTATE 23514): it is
// reported in Waiting, not as an error. Each CREATE and DROP waits at most
// dropLockTimeout for its lock, then gives up until the next run (Skipped).
// Times are the database clock's and UUIDv7 milliseconds since the Unix
// epoch; neither the process's TZ nor the session's TimeZone enters.
//
// q must be a connection or pool (each statement commits by itself). The
// Purger calls it on every run, under its lock; Migrate creates the first
// spans.
func (s *Store) MaintainPartitions(ctx context.Context, q sqldb.Querier, purgeHorizon time.Duration) (PartitionReport, error) {
	var rep PartitionReport
	if s.layout != LayoutPartitioned {
		return rep, ErrNotPartitioned
	}
	if s.horizon <= 0 || purgeHorizon < s.horizon {
		return rep, fmt.Errorf("%w: purge horizon %s, store horizon %s", ErrHorizonBelowClaim, purgeHorizon, s.horizon)
	}
	return s.maintain(ctx, q, purgeHorizon, "")
}

// maintainLocked is MaintainPartitions with lock, a statement sent in each
// CREATE's and DROP's implicit transaction after its lock timeout and
// before it (the purge lock, taken by the statement itself: the Purger's
// lock is transaction-scoped).
func (s *Store) maintainLocked(ctx context.Context, q sqldb.Querier, purgeHorizon time.Duration, lock string) (PartitionReport, error) {
	if s.horizon <= 0 || purgeHorizon < s.horizon {
		return PartitionReport{}, fmt.Errorf("%w: purge horizon %s, store horizon %s", ErrHorizonBelowClaim, purgeHorizon, s.horizon)
	}
	return s.maintain(ctx, q, purgeHorizon, lock)
}

// maintain creates the spans ahead and, with purgeHorizon > 0, drops the
// partitions wholly older than now() − purgeHorizon.
func (s *Store) maintain(ctx context.Context, q sqldb.Querier, purgeHorizon time.Duration, lock string) (PartitionReport, error) {
	var rep PartitionReport
	now, err := dbClock(ctx, q)
	if err != nil {
		return rep, err
	}
	existing, err := s.partitions(ctx, q)
	if err != nil {
		return rep, err
	}
	span := s.span
	parent := s.table.Quoted('"')
	lockTimeout := fmt.Sprintf("SET LOCAL lock_timeout = '%dms'; ", dropLockTimeout.Milliseconds()) + lock
	names := map[string]bool{}
	for _, p := range existing {
		names[p.name] = true
	}
	for start := now.Truncate(span); !start.After(now.Add(s.skew + partitionAhead*span)); start = start.Add(span) {
		for _, piece := range uncovered(start.UnixMilli(), start.Add(span).UnixMilli(), existing) {
			from, to := time.UnixMilli(piece[0]).UTC(), time.UnixMilli(piece[1]).UTC()
			suffix := "p" + from.Format(partitionSuffix)
			name := s.table.Name() + "_" + suffix
			if piece[0]%60000 != 0 || names[name] {
				// A sliver left by a partition an operator made with
				// bounds off the minute (or a name taken by one): its
				// claims go to the default partition, DELETE-purged.
				continue
			}
			var busy bool
			if err := q.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE event_id >= $1 AND event_id < $2)`, s.sibling("default")),
				v7Bound(from), v7Bound(to)).Scan(&busy); err != nil {
				rep.Skipped = append(rep.Skipped, fmt.Errorf("create %s: read the default partition: %w", name, err))
				continue
			}
			if busy {
				rep.Waiting = append(rep.Waiting, name)
				continue
			}
			stmt := fmt.Sprintf(`%sCREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
				lockTimeout, s.sibling(suffix), parent, v7Bound(from), v7Bound(to))
			if _, err := q.Exec(ctx, stmt); err != nil {
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && pgErr.Code == "23514" {
					// A claim put a row of this range into the default
					// partition since the check above.
					rep.Waiting = append(rep.Waiting, name)
					continue
				}
				rep.Skipped = append(rep.Skipped, fmt.Errorf("create %s: %w", name, err))
				continue
			}
			names[name] = true
			existing = append(existing, partition{name: name, lo: piece[0], hi: piece[1]})
			rep.Created = append(rep.Created, name)
		}
	}
	if purgeHorizon <= 0 {
		return rep, nil
	}
	cutoff := now.Add(-purgeHorizon)
	for _, p := range existing {
		if !p.wholeBefore(cutoff) {
			continue
		}
		schema := ""
		if sc, _, ok := strings.Cut(s.table.String(), "."); ok {
			schema = `"` + sc + `".`
		}
		// One implicit transaction (simple protocol, no parameters): the
		// lock timeout applies to this DROP only.
		stmt := fmt.Sprintf(`%sDROP TABLE IF EXISTS %s"%s"`, lockTimeout, schema, p.name)
		if _, err := q.Exec(ctx, stmt); err != nil {
			rep.Skipped = append(rep.Skipped, fmt.Errorf("drop %s: %w", p.name, err))
			continue
		}
		rep.Dropped = append(rep.Dropped, p.name)
	}
	return rep, nil
}

// spanStatements returns the CREATE statements of the spans from now's to
// now + MaxFutureSkew + 3 spans, for an empty partitioned table (the
// switch of MigrateToPartitioned, before any claim can reach it).
func (s *Store) spanStatements(now time.Time) []string {
	var out []string
	for start := now.Truncate(s.span); !start.After(now.Add(s.skew + partitionAhead*s.span)); start = start.Add(s.span) {
		out = append(out, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
			s.sibling("p"+start.UTC().Format(partitionSuffix)), s.table.Quoted('"'), v7Bound(start), v7Bound(start.Add(s.span))))
	}
	return out
}

// dropLockTimeout bounds a partition create's or drop's wait for its lock,
// so claims never queue behind it for longer.
const dropLockTimeout = 2 * time.Second

// partition is one range partition of the table: the UUIDv7 times (Unix
// milliseconds) its range [lo, hi) covers, widened to whole milliseconds
// (lo rounded down, hi up); MINVALUE is 0 and MAXVALUE maxMs.
type partition struct {
	name   string
	lo, hi int64
}

const maxMs = int64(1) << 48

// wholeBefore reports whether every event p can hold is dated before
// cutoff: the newest a range [lo, hi) can hold is dated hi − 1 ms (a
// UUIDv7's time is its first 48 bits, in milliseconds).
func (p partition) wholeBefore(cutoff time.Time) bool {
	return p.hi != maxMs && time.UnixMilli(p.hi-1).Before(cutoff)
}

// dbClock reads the database clock (PostgreSQL now()) in UTC.
func dbClock(ctx context.Context, q sqldb.Querier) (time.Time, error) {
	var clock string
	if err := q.QueryRow(ctx, `SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`).Scan(&clock); err != nil {
		return time.Time{}, fmt.Errorf("processed: partitions: clock: %w", err)
	}
	now, err := time.Parse(time.RFC3339Nano, clock)
	if err != nil {
		return time.Time{}, fmt.Errorf("processed: partitions: clock %q: %w", clock, err)
	}
	return now, nil
}

// DropPreview returns the time partitions a Purger at horizon would drop
// now (LayoutPartitioned: those wholly older than the database clock
// minus horizon and purgeClaimSlack, as maintenance judges them) and how
// many rows they hold; nothing on the plain layout.
func (s *Store) DropPreview(ctx context.Context, q sqldb.Querier, horizon time.Duration) (names []string, rows int64, err error) {
	if s.layout != LayoutPartitioned || horizon <= 0 {
		return nil, 0, nil
	}
	now, err := dbClock(ctx, q)
	if err != nil {
		return nil, 0, err
	}
	existing, err := s.partitions(ctx, q)
	if err != nil {
		return nil, 0, err
	}
	for _, p := range existing {
		if p.wholeBefore(now.Add(-horizon - purgeClaimSlack)) {
			names = append(names, p.name)
		}
	}
	if len(names) == 0 {
		return nil, 0, nil
	}
	parent := s.table.Quoted('"')
	if err := q.QueryRow(ctx, `SELECT count(*) FROM `+parent+` WHERE tableoid IN (SELECT i.inhrelid FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass AND c.relname = ANY($2))`, parent, names).Scan(&rows); err != nil {
		return nil, 0, fmt.Errorf("processed: partitions: count the rows to drop: %w", err)
	}
	return names, rows, nil
}

// uncovered is [from, to) minus the ranges of existing, as pieces in order.
func uncovered(from, to int64, existing []partition) [][2]int64 {
	pieces := [][2]int64{{from, to}}
	for _, p := range existing {
		var next [][2]int64
		for _, c := range pieces {
			if p.hi <= c[0] || p.lo >= c[1] {
				next = append(next, c)
				continue
			}
			if p.lo > c[0] {
				next = append(next, [2]int64{c[0], p.lo})
			}
			if p.hi < c[1] {
				next = append(next, [2]int64{p.hi, c[1]})
			}
		}
		pieces = next
	}
	return pieces
}

// boundRE matches one bound of a range partition's relpartbound text: a
// quoted uuid, MINVALUE or MAXVALUE.
var boundRE = regexp.MustCompile(`'([0-9a-f-]{36})'|MINVALUE|MAXVALUE`)

// partitions lists the range partitions of the table with their bounds, read
// from the catalog (the default partition is left out).
func (s *Store) partitions(ctx context.Context, q sqldb.Querier) ([]partition, error) {
	var list string
	err := q.QueryRow(ctx, `SELECT coalesce(string_agg(c.relname || '|' || pg_get_expr(c.relpartbound, c.oid), E'\n'), '')
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass`, s.table.Quoted('"')).Scan(&list)
	if err != nil {
		return nil, fmt.Errorf("processed: partitions: list: %w", err)
	}
	var out []partition
	for _, line := range strings.Split(list, "\n") {
		name, expr, ok := strings.Cut(line, "|")
		if !ok {
			continue
		}
		m := boundRE.FindAllStringSubmatch(expr, -1)
		if len(m) != 2 { // DEFAULT
			continue
		}
		p := partition{name: name}
		for i, b := range m {
			v := int64(0)
			switch {
			case b[0] == "MAXVALUE":
				v = maxMs
			case b[1] != "":
				id, err := uuid.Parse(b[1])
				if err != nil {
					return nil, fmt.Errorf("processed: partitions: %s bound %q: %w", name, b[1], err)
				}
				for _, x := range id[:6] {
					v = v<<8 | int64(x)
				}
				if i == 1 && string(id[6:]) != string(make([]byte, 10)) {
					v++ // ids of that millisecond below the bound: covered
				}
			}
			if i == 0 {
				p.lo = v
			} else {
				p.hi = v
			}
		}
		out = append(out, p)
	}
	return out, nil
}
