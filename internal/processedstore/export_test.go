package processedstore

// PurgeSQL is the store's purge batch statement (tests: EXPLAIN of it).
func PurgeSQL(s *Store) string { return s.purgeSQL }
