package operation

// PostgreSQL SQL text of the operations table. Every statement of the
// dialect is here; %[1]s is the quoted table name, %[2]s the column list
// that scanRecord reads. $1 is always the key (text) where present, $2 the
// owner token (uuid) of the attempt.

const recordColumns = `key, kind, fingerprint, state, reference, result, error, attempts, owner, created_at, updated_at`

const (
	// pgTryLock takes the key's session-level advisory lock if it is free.
	// Session-level: it survives the COMMIT of the begin transaction and is
	// held through the external call, until pgUnlock or the end of the
	// session (a crashed process's connection closes, the server releases
	// it). That is how a live holder is told from a dead one.
	pgTryLock = `SELECT pg_try_advisory_lock($1)`

	// pgLock waits for the key's advisory lock, bounded by the transaction's
	// lock_timeout (pgLockTimeout): 55P03 when it expires.
	pgLock = `SELECT pg_advisory_lock($1)`

	// pgUnlock releases the lock; false means this session did not hold it.
	pgUnlock = `SELECT pg_advisory_unlock($1)`

	// pgLockTimeout sets lock_timeout for the current transaction only; $1 is
	// text such as '5000ms'.
	pgLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

	// pgPeek reads the fingerprint without the lock, while another worker
	// holds the key: a conflicting request is refused without waiting.
	pgPeek = `SELECT fingerprint FROM %[1]s WHERE key = $1`

	// pgClaim inserts the started record, or returns the existing one: one
	// statement, and the caller holds the key's advisory lock, so the row
	// read is not moving. The SELECT branch reads the snapshot of this
	// statement, taken after the lock was granted, so it sees what the
	// previous holder committed before unlocking. ON CONFLICT DO NOTHING
	// never raises 23505 (which would abort the transaction).
	pgClaim = `WITH ins AS (
    INSERT INTO %[1]s (key, kind, fingerprint, state, owner, attempts)
    VALUES ($1, $3, $4, 'started', $2, 1)
    ON CONFLICT (key) DO NOTHING
    RETURNING %[2]s
)
SELECT true, %[2]s FROM ins
UNION ALL
SELECT false, %[2]s FROM %[1]s WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`

	// pgTake makes this attempt the owner of an existing record, moving it to
	// state $3, if it is still in state $4 with owner $5 as read under the
	// lock (a compare-and-set: 0 rows means it moved, which the lock rules
	// out unless someone edited the table by hand).
	pgTake = `UPDATE %[1]s SET owner = $2, attempts = attempts + 1, state = $3, updated_at = now()
WHERE key = $1 AND state = $4 AND owner IS NOT DISTINCT FROM $5
RETURNING attempts`

	// The outcome writes: each moves the row only if this attempt ($2) still
	// owns it. 0 rows: ownership lost.

	// pgSucceed records success with the provider's reference and result.
	pgSucceed = `UPDATE %[1]s SET state = 'succeeded', reference = NULLIF($3, ''), result = $4,
    updated_at = now(), finished_at = now()
WHERE key = $1 AND owner = $2 AND state IN ('started', 'uncertain')`

	// pgFail records a definite rejection.
	pgFail = `UPDATE %[1]s SET state = 'failed', reference = COALESCE(NULLIF($3, ''), reference), error = $4,
    updated_at = now(), finished_at = now()
WHERE key = $1 AND owner = $2 AND state IN ('started', 'uncertain')`

	// pgUncertain records that the call's outcome is unknown.
	pgUncertain = `UPDATE %[1]s SET state = 'uncertain', reference = COALESCE(NULLIF($3, ''), reference), error = $4,
    updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'started'
RETURNING COALESCE(reference, '')`

	// pgRelease gives the key back after a call that certainly had no
	// effect: started with no owner, so the next attempt calls again.
	pgRelease = `UPDATE %[1]s SET owner = NULL, error = $3, updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'started'`

	// pgRestart moves an uncertain record back to started after the
	// reconcile function reported that the provider has no trace of it.
	pgRestart = `UPDATE %[1]s SET state = 'started', updated_at = now()
WHERE key = $1 AND owner = $2 AND state = 'uncertain'`

	// pgResolve applies a Resolve verdict to a record that is started or
	// uncertain, under the key's lock. A "started" verdict (not executed)
	// leaves no owner: the next Do calls.
	pgResolve = `UPDATE %[1]s SET state = $3,
    owner = CASE WHEN $3 = 'started' THEN NULL ELSE $2::uuid END,
    reference = COALESCE(NULLIF($4, ''), reference),
    result = CASE WHEN $3 = 'succeeded' THEN $5 ELSE result END,
    error = COALESCE(NULLIF($6, ''), error),
    updated_at = now(),
    finished_at = CASE WHEN $3 IN ('succeeded', 'failed') THEN now() END
WHERE key = $1 AND state IN ('started', 'uncertain')`

	// pgGet reads one record.
	pgGet = `SELECT %[2]s FROM %[1]s WHERE key = $1`
)
