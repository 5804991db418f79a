package processed

// PostgreSQL SQL text of the processed-event store. Every statement of the
// dialect is here; %[1]s is the quoted table name. $1 is always the consumer
// (text), $2 the event_id (uuid) where present.

const (
	// pgClaim is the claim: one statement, one round trip. Zero rows affected
	// means the (consumer, event_id) row exists (committed by someone else, or
	// committed after we waited on its uncommitted insert): a duplicate. A
	// unique violation is never raised, so the transaction is never aborted
	// (catching 23505 would leave it in state 25P02).
	pgClaim = `INSERT INTO %[1]s (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`

	pgExists = `SELECT EXISTS (SELECT 1 FROM %[1]s WHERE consumer = $1 AND event_id = $2)`

	// pgPurgeBatch deletes at most $2 rows whose processed_at is older than
	// the database clock minus $1 microseconds. now() is the statement's
	// transaction start on the server, so neither the process's TZ nor the
	// session's timezone enters the cutoff; a microsecond interval has no
	// calendar (DST) component.
	pgPurgeBatch = `DELETE FROM %[1]s WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM %[1]s
    WHERE processed_at < now() - ($1::bigint * interval '1 microsecond')
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`

	// pgLockTimeout sets the lock timeout of the current transaction only;
	// $1 is text such as '15000ms'.
	pgLockTimeout = `SELECT set_config('lock_timeout', $1, true)`

	// pgMigrationsTable records applied migrations of every component.
	pgMigrationsTable = `CREATE TABLE IF NOT EXISTS idempotency_migration (
    component  text        NOT NULL,
    version    int         NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)`

	// pgMigrationLock serialises Migrate across processes for the rest of
	// the implicit transaction the script runs in.
	pgMigrationLock = `SELECT pg_advisory_xact_lock(%d)`
)

const (
	// pgPurgeTryLock / pgPurgeUnlock: a session-level advisory lock, held by
	// the purging connection for one whole run, so that one purger works at a
	// time across processes; the others skip the run.
	pgPurgeTryLock = `SELECT pg_try_advisory_lock($1)`
	pgPurgeUnlock  = `SELECT pg_advisory_unlock($1)`
)
