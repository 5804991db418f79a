package processed

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/sqldb"
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
}

// ErrNotPartitioned is returned by MaintainPartitions on a LayoutPlain store.
var ErrNotPartitioned = errors.New("processed: the store's layout is not partitioned")

// MaintainPartitions creates the time partitions of the next spans, up to
// now() + MaxFutureSkew + 3 spans by the database clock, and drops every
// partition whose whole span ends at or before now() − purgeHorizon: all its
// rows are then dated before now() − purgeHorizon, so, with purgeHorizon ≥
// the store's Horizon, the claim refuses every one of their redeliveries (a
// partition is never dropped while a redelivery of one of its events could
// still be accepted). Each DROP waits at most dropLockTimeout for its lock
// (it needs an ACCESS EXCLUSIVE lock on the parent for a moment), then
// gives up until the next run. q must be a connection or pool (each
// statement commits by itself). The Purger calls it on every run.
func (s *Store) MaintainPartitions(ctx context.Context, q sqldb.Querier, purgeHorizon time.Duration) (PartitionReport, error) {
	var rep PartitionReport
	if s.layout != LayoutPartitioned {
		return rep, ErrNotPartitioned
	}
	if s.horizon <= 0 || purgeHorizon < s.horizon {
		return rep, fmt.Errorf("%w: purge horizon %s, store horizon %s", ErrHorizonBelowClaim, purgeHorizon, s.horizon)
	}
	var clock string
	if err := q.QueryRow(ctx, `SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`).Scan(&clock); err != nil {
		return rep, fmt.Errorf("processed: partitions: clock: %w", err)
	}
	now, err := time.Parse(time.RFC3339Nano, clock)
	if err != nil {
		return rep, fmt.Errorf("processed: partitions: clock %q: %w", clock, err)
	}
	existing, err := s.partitions(ctx, q)
	if err != nil {
		return rep, err
	}
	span := s.span
	parent := s.table.Quoted('"')
	for start := now.Truncate(span); !start.After(now.Add(s.skew + partitionAhead*span)); start = start.Add(span) {
		name := s.table.Name() + "_p" + start.UTC().Format(partitionSuffix)
		if _, ok := existing[name]; ok {
			continue
		}
		stmt := fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
			s.sibling("p"+start.UTC().Format(partitionSuffix)), parent, v7Bound(start), v7Bound(start.Add(span)))
		if _, err := q.Exec(ctx, stmt); err != nil {
			rep.Skipped = append(rep.Skipped, fmt.Errorf("create %s: %w", name, err))
			continue
		}
		rep.Created = append(rep.Created, name)
	}
	cutoff := now.Add(-purgeHorizon)
	for name, start := range existing {
		if start.Add(span).After(cutoff) {
			continue
		}
		// One implicit transaction (simple protocol, no parameters): the
		// lock timeout applies to this DROP only.
		stmt := fmt.Sprintf("SET LOCAL lock_timeout = '%dms'; DROP TABLE IF EXISTS %s", dropLockTimeout.Milliseconds(), s.sibling(strings.TrimPrefix(name, s.table.Name()+"_")))
		if _, err := q.Exec(ctx, stmt); err != nil {
			rep.Skipped = append(rep.Skipped, fmt.Errorf("drop %s: %w", name, err))
			continue
		}
		rep.Dropped = append(rep.Dropped, name)
	}
	return rep, nil
}

// dropLockTimeout bounds a partition drop's wait for its lock, so claims
// never queue behind it for longer.
const dropLockTimeout = 2 * time.Second

// partitions lists the time partitions of the table: name → span start.
func (s *Store) partitions(ctx context.Context, q sqldb.Querier) (map[string]time.Time, error) {
	var names string
	err := q.QueryRow(ctx, `SELECT coalesce(string_agg(c.relname, ','), '') FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = $1::regclass`, s.table.Quoted('"')).Scan(&names)
	if err != nil {
		return nil, fmt.Errorf("processed: partitions: list: %w", err)
	}
	out := map[string]time.Time{}
	prefix := s.table.Name() + "_p"
	for _, n := range strings.Split(names, ",") {
		rest, ok := strings.CutPrefix(n, prefix)
		if !ok {
			continue
		}
		t, err := time.Parse(partitionSuffix, rest)
		if err != nil {
			continue
		}
		out[n] = t
	}
	return out, nil
}
