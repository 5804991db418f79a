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
