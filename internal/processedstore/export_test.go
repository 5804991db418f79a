package processedstore

import "time"

// PurgeSQL is the store's purge batch statement (tests: EXPLAIN of it).
func PurgeSQL(s *Store) string { return s.purgeSQL }

// SetClock sets the process clock the store's SQLite statements read
// (time.Now by default).
func SetClock(s *Store, now func() time.Time) { s.now = now }

// PurgeClaimSlack is how much longer than its horizon the Purger keeps a
// row (purgeClaimSlack).
const PurgeClaimSlack = purgeClaimSlack

// SetV7BarrierTimeout sets how long copyV7 waits for the claims in flight
// and returns a function restoring it.
func SetV7BarrierTimeout(d time.Duration) func() {
	old := v7BarrierTimeout
	v7BarrierTimeout = d
	return func() { v7BarrierTimeout = old }
}
