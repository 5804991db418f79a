package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strconv"
	"time"
	"unsafe"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// The prepared claim (issue 17): on a pool whose DefaultQueryExecMode is
// pgx.QueryExecModeCacheStatement, BEGIN and the claim are prepared once
// per connection (named statements, PgConn.Prepare) and then sent in one
// pgconn.Batch (Bind/Describe/Execute each, one Sync: one round trip) with
// parameters encoded by this file into buffers kept per connection: the
// consumer and the event name as text, the event id as 16 binary bytes,
// the event time as binary timestamptz (or NULL), the fingerprint as binary
// bytea. pgx's Batch, its pipeline state and its type mapping are not
// involved. The claim is processedstore.Store's one INSERT … ON CONFLICT DO
// NOTHING (ClaimParamsAt); with Config.LockTimeout the dialect's SET LOCAL
// lock_timeout is a prepared statement of the same batch, between BEGIN
// and the claim, so the claim's lock on its table is bounded too (a
// set_config in the claim's own WHERE runs after the executor took that
// lock).
//
// A connection that lost the statements (DISCARD ALL, DEALLOCATE ALL, a
// pooler's reset) answers 26000 (invalid_sql_statement_name): the attempt
// rolls back what the batch opened, forgets the connection's statements,
// prepares them again and resends the batch once; a second failure is the
// attempt's error (classified by claimError), never a loop.
//
// Poolers. A statement's name is "idempotency_" and a hash of its SQL text
// (as pgx's own statement cache names its statements), never a number of
// the process: behind a pooler that shares server connections between
// clients without tracking named statements (PgBouncer in transaction
// pooling before 1.21, or with max_prepared_statements = 0), a name that
// another process prepared on that server connection is the same SQL, so
// executing it can never run another service's claim. Such a pooler shows
// itself by what a direct connection never answers: 42P05 (duplicate
// prepared statement) when this connection prepares a name it never
// prepared, or 26000 again right after the statements were prepared anew.
// The beginner then stops naming statements for good (pgxBeginner.pooled):
// BEGIN, the lock timeout and the claim travel as unnamed statements
// (Parse, Bind, Execute each) in one pgconn.Batch, still one round trip,
// which any pooler keeps on one server connection.

// preparedClaimKey is the key of the per-connection state in
// pgconn.PgConn.CustomData.
const preparedClaimKey = "github.com/watermill-idempotency/idempotency/middleware.preparedClaim"

// stmtName is the name of sql's statement: "idempotency_" and 24 bytes of
// its SHA-256 in hex (60 characters, within PostgreSQL's 63), so a name
// identifies its SQL on every connection of every process.
func stmtName(sql string) string {
	d := sha256.Sum256([]byte(sql))
	return "idempotency_" + hex.EncodeToString(d[:24])
}

// PostgreSQL type OIDs of the claim's parameters.
const (
	oidText        = 25
	oidVarchar     = 1043
	oidUUID        = 2950
	oidTimestamptz = 1184
	oidBytea       = 17
	oidInt4        = 23
)

// preparedStmt is one statement prepared on a connection; ok is false when
// its parameter types are not the ones this file encodes (the claim then
// takes the pgx.Batch path on that connection).
type preparedStmt struct {
	sql, name string
	ok        bool
}

// connClaim is the per-connection state: the prepared statements and the
// parameter buffers. A pooled connection serves one attempt at a time, so
// the buffers are reused without locking.
type connClaim struct {
	stmts []preparedStmt
	// lockMs is the lock_timeout, in milliseconds, this connection's
	// session was set to by sessionLock (0: not set); shared: its server
	// session is not its own (a pooler), so the lock timeout is SET LOCAL.
	lockMs int64
	shared bool
	// sessionOwn is the session's lock_timeout before sessionLock first
	// set it (restoreSessionLock); changed: sessionLock set the session's
	// setting and nobody put sessionOwn back since. lockMs is what the
	// setting is known to be, so it is forgotten (0) when a handler may
	// have changed it or the statements were lost, while changed and
	// sessionOwn stay: the value to put back is still the one from before
	// the first setting, never a value of ours read back.
	sessionOwn string
	changed    bool
	// lockClaims counts the claims made under the session's setting since
	// sessionLock last set it; at sessionLockRecheck it is set again.
	lockClaims int
	// dbAt is the database clock (statement_timestamp()) sessionLock last
	// read on this connection: the database clock is no earlier now
	// (nearSkew).
	dbAt time.Time
	// backstops are this connection's lean claims with the lock timeout
	// in their WHERE (withLockBackstop), sent once the connection is raw.
	backstops []backstop
	// plain are the last handler statements handlerStatement found
	// neither to name a session setting nor to possibly end the
	// transaction, by identity; plainNext is the next to replace.
	plain     [4]sqlText
	plainNext uint8
	// raw: a handler reached this connection's pgx.Conn (pgxTx.Conn, the
	// Conn of rows it read, a query rewriter of its own, which pgx hands
	// the connection) or prepared a statement that may end a transaction,
	// so a query string may name a prepared statement the scan never saw:
	// from then on every claimed attempt on it commits with the guard's
	// statement.
	raw bool
	// guardUnnamed: the connection's named guard statement was lost or
	// invalidated during a transaction (26000, 0A000: a handler's
	// DEALLOCATE, a changed table): the guard is sent unnamed on it from
	// then on, so that an attempt that fails so once succeeds when retried.
	guardUnnamed bool
	// guardReady is the guard whose statement and COMMIT's are prepared
	// on the connection (prepareGuard); forget and forgetStmt clear it.
	guardReady string
	// begun is a batch holding BEGIN's prepared execution (begunName:
	// its statement), encoded once per connection. An attempt copies the
	// value and appends its claim to the copy: the copy's first appends
	// may reuse the spare capacity of begun's buffer, beyond its length,
	// which only this connection's one attempt at a time writes, and
	// begun's own bytes are never written. It saves the buffer's growth
	// from empty, 3 allocations a claim (issue 25).
	begun     pgconn.Batch
	begunName string
	vals      [5][]byte
	formats   [5]int16
	text      [2][]byte // consumer, event name
	fp        []byte    // the fingerprint
	uuid      [16]byte
	ts        [8]byte
	i4        [4]byte // a <table>_v7 claim's consumer id
}

func connClaimOf(pc *pgconn.PgConn) *connClaim {
	data := pc.CustomData()
	if st, ok := data[preparedClaimKey].(*connClaim); ok {
		return st
	}
	st := &connClaim{formats: [5]int16{0, 1, 1, 0, 1}}
	data[preparedClaimKey] = st
	return st
}

// find returns sql's statement if it is prepared on the connection.
func (st *connClaim) find(sql string) (preparedStmt, bool) {
	for _, s := range st.stmts {
		if s.sql == sql {
			return s, true
		}
	}
	return preparedStmt{}, false
}

// has reports whether sql's statement is prepared on the connection.
func (st *connClaim) has(sql string) bool {
	_, ok := st.find(sql)
	return ok
}

// stmt returns sql's statement on pc, preparing it first when needed.
// types, when not nil, are the parameter types the statement must have
// (each entry: the accepted OIDs).
func (st *connClaim) stmt(ctx context.Context, pc *pgconn.PgConn, sql string, types [][]uint32) (preparedStmt, error) {
	if s, ok := st.find(sql); ok {
		return s, nil
	}
	s := preparedStmt{sql: sql, name: stmtName(sql)}
	sd, err := pc.Prepare(ctx, s.name, sql, nil)
	if err != nil {
		if sqlState(err) == "42P05" {
			// This connection never prepared the name: its server
			// session is shared with other clients (a pooler).
			return preparedStmt{}, errPooled
		}
		return preparedStmt{}, err
	}
	s.ok = paramTypesMatch(sd.ParamOIDs, types)
	st.stmts = append(st.stmts, s)
	return s, nil
}

func paramTypesMatch(got []uint32, want [][]uint32) bool {
	if want == nil {
		return len(got) == 0
	}
	if len(got) != len(want) {
		return false
	}
next:
	for i, oid := range got {
		for _, w := range want[i] {
			if oid == w {
				continue next
			}
		}
		return false
	}
	return true
}

var (
	claimTypes = [][]uint32{{oidText, oidVarchar}, {oidUUID}, {oidTimestamptz}}
	// claimIdentityTypes: claimTypes and the identity columns.
	claimIdentityTypes = [][]uint32{{oidText, oidVarchar}, {oidUUID}, {oidTimestamptz}, {oidText, oidVarchar}, {oidBytea}}
	// claimV7Types: the claim in <table>_v7 (ClaimParams.ConsumerID),
	// with the fingerprint when it has an identity.
	claimV7Types         = [][]uint32{{oidInt4}, {oidUUID}, {oidTimestamptz}}
	claimV7IdentityTypes = [][]uint32{{oidInt4}, {oidUUID}, {oidTimestamptz}, {oidBytea}}
	// claimV7OIDs and claimV7Formats: its parameters, all binary.
	claimV7OIDs    = []uint32{oidInt4, oidUUID, oidTimestamptz, oidBytea}
	claimV7Formats = []int16{1, 1, 1, 1}
)

// microseconds from 1970-01-01 to 2000-01-01, PostgreSQL's epoch for the
// binary timestamptz.
const pgEpochMicros = 946684800 * 1000000

// encode fills the parameter buffers for p and returns the values.
func (st *connClaim) encode(p *processedstore.ClaimParams) [][]byte {
	st.text[0] = append(st.text[0][:0], p.Consumer...)
	st.vals[0] = st.text[0]
	if p.ConsumerID != 0 {
		id := uint32(p.ConsumerID)
		st.i4 = [4]byte{byte(id >> 24), byte(id >> 16), byte(id >> 8), byte(id)}
		st.vals[0] = st.i4[:]
	}
	st.uuid = p.EventID
	st.vals[1] = st.uuid[:]
	st.vals[2] = nil // NULL
	if p.HasEventAt {
		// As pgx encodes a time.Time: whole microseconds since 2000-01-01 UTC.
		us := p.EventAt.Unix()*1000000 + int64(p.EventAt.Nanosecond())/1000 - pgEpochMicros
		for i := 7; i >= 0; i-- {
			st.ts[i] = byte(us)
			us >>= 8
		}
		st.vals[2] = st.ts[:]
	}
	if !p.Identity {
		return st.vals[:3]
	}
	if p.ConsumerID != 0 {
		st.vals[3] = nil // NULL
		if p.FingerprintLen > 0 {
			st.fp = append(st.fp[:0], p.Fingerprint[:p.FingerprintLen]...)
			st.vals[3] = st.fp
		}
		return st.vals[:4]
	}
	st.text[1] = append(st.text[1][:0], p.EventName...)
	st.vals[3] = st.text[1]
	st.vals[4] = nil // NULL, as pgx sends a nil []byte
	if p.FingerprintLen > 0 {
		st.fp = append(st.fp[:0], p.Fingerprint[:p.FingerprintLen]...)
		st.vals[4] = st.fp
	}
	return st.vals[:5]
}

// forget drops the connection's statements (the server lost them).
// It also forgets the session's lock timeout: what drops every statement
// (DISCARD ALL, a pooler's reset) resets the session's settings too.
func (st *connClaim) forget() { st.stmts, st.lockMs, st.guardReady = st.stmts[:0], 0, "" }

// sessionLock makes d the lock_timeout of conn's session, once per
// connection (and again after forget or handlerStatement), and reports
// whether it is: then the claim's batch carries no SET LOCAL (issue 25:
// 12k server instructions an attempt); on a raw connection the claim also
// sets the same value for its own transaction in its WHERE
// (withLockBackstop), and on every connection sessionLock sets it again
// after sessionLockRecheck claims. It is not when
// the connection's server session may be another client's (a pooler:
// PgBouncer, in any pool mode, gives its clients a BackendKeyData of its
// own, so the process ID the connection was given at startup is not
// pg_backend_pid()): there a session setting would stay on a server
// connection other clients use and be missing from the one the next claim
// gets, so the SET LOCAL stays. The round trip goes through pgx.Conn, so
// a tracer on the pool sees it. The session's value before the first
// setting is kept for a consumer with no lock timeout
// (restoreSessionLock). An error is the connection's (nothing is open).
func (st *connClaim) sessionLock(ctx context.Context, conn *pgx.Conn, d time.Duration) (bool, error) {
	ms := d.Milliseconds()
	switch {
	case st.shared:
		return false, nil
	case st.lockMs == ms:
		return true, nil
	}
	// CASE evaluates its THEN only when the PIDs match: no setting is
	// changed on a session that is not this connection's own. The clock
	// comes as whole microseconds since the Unix epoch (nearSkew): a
	// timestamptz in the simple protocol is text in the session's
	// DateStyle and TimeZone, which pgx parses only in ISO with a
	// two-digit offset.
	var own string
	var set *string
	var dbUs int64
	if err := conn.QueryRow(ctx, "SELECT current_setting('lock_timeout'), CASE WHEN pg_backend_pid()::bigint = $1::bigint THEN set_config('lock_timeout', $2, false) END, (extract(epoch FROM statement_timestamp()) * 1000000)::bigint",
		pgx.QueryExecModeSimpleProtocol, int64(conn.PgConn().PID()), strconv.FormatInt(ms, 10)+"ms").Scan(&own, &set, &dbUs); err != nil {
		return false, err
	}
	if set == nil {
		st.shared = true
		return false, nil
	}
	st.dbAt = time.UnixMicro(dbUs)
	if !st.changed {
		st.sessionOwn, st.changed = own, true
	}
	st.lockMs, st.lockClaims = ms, 0
	return true, nil
}

// nearSkew reports whether p's event is dated before the database clock
// sessionLock last read on this connection plus skew, so that its claim
// may go without the window's future arm (ClaimParams.SQLNear): the
// database clock when the claim runs is no earlier than that reading. No
// process clock is read. When it is not (an event dated ahead, or a
// reading grown old on a connection that claimed little since), the next
// claim reads the database clock again. An event without a time has
// nothing to refuse. A database clock stepped back since the reading lets
// an event dated up to that step beyond the skew through: the purge keeps
// it longer, nothing else (the past arm, which the purge's safety rests
// on, is in both statements).
func (st *connClaim) nearSkew(p *processedstore.ClaimParams, skew time.Duration) bool {
	switch {
	case st.dbAt.IsZero():
		return false
	case !p.HasEventAt || p.EventAt.Before(st.dbAt.Add(skew)):
		return true
	}
	st.lockMs = 0
	return false
}

// sessionLockRecheck is how many claims a connection makes under its
// session's lock_timeout before sessionLock sets it again: a session-level
// change the claim cannot see (a function the handler calls, other code on
// the pool running RESET ALL) lasts at most that many claims on that
// connection. One round trip in 256 claims; a claim statement checking
// the setting itself costs about 8k server instructions on every claim
// (issue 25), so it is sent only on a raw connection.
const sessionLockRecheck = 256

// restoreSessionLock gives conn's session back the lock_timeout it had
// before sessionLock set it, for a consumer whose LockTimeout is negative
// (it promises to leave the session's setting alone) on a pool another
// consumer set it on.
func (st *connClaim) restoreSessionLock(ctx context.Context, conn *pgx.Conn) error {
	if _, err := conn.Exec(ctx, "SELECT set_config('lock_timeout', $1, false)", pgx.QueryExecModeSimpleProtocol, st.sessionOwn); err != nil {
		return err
	}
	st.lockMs, st.changed = 0, false
	return nil
}

// withLockBackstop is sql, the lean claim, with the lock timeout d set for
// its transaction too (processedstore.LeanClaimWithLockTimeout), the
// claim a raw connection sends: what a handler sent through the
// connection itself may have changed the session's setting unseen, on
// every later attempt, so there the wait on another transaction's claim
// of the same event and every handler statement stay bounded by d; only
// the claim's table lock depends on the session's setting. Built once per
// connection and timeout; ok is false for a statement that is not a lean
// claim (the caller keeps the SET LOCAL).
func (st *connClaim) withLockBackstop(sql string, d time.Duration) (string, bool) {
	for _, b := range st.backstops {
		if b.base == sql && b.d == d {
			return b.sql, true
		}
	}
	q, ok := processedstore.LeanClaimWithLockTimeout(sql, d)
	if ok {
		st.backstops = append(st.backstops, backstop{base: sql, d: d, sql: q})
	}
	return q, ok
}

// backstop is a lean claim (base) with the lock timeout d in its WHERE.
type backstop struct {
	base, sql string
	d         time.Duration
}

// handlerStatement records sql, a statement a handler sends through the
// attempt's pgxTx, and reports whether it may end the transaction
// (mayEndTx). It also forgets the session's lock timeout, so that the
// next claim sets it again, when sql may change session settings
// (mentionsSessionSetting) or may end the transaction (whatever runs
// statements the scan does not see: EXECUTE, a prepared
// statement's name): a handler's SET SESSION lock_timeout or RESET ALL,
// committed, would otherwise stay the session's value under that
// connection's later claims. Statements hidden in a function the handler
// calls are not seen (Config.LockTimeout says so).
//
// A statement found to do neither is remembered by its text's address and
// length (plain): a handler sends the same constant strings on every
// attempt, and a Go string's bytes never change, so each is scanned once
// per connection instead of once per execution (about 1k client
// instructions a statement, issue 25).
func (st *connClaim) handlerStatement(sql string) (mayEnd bool) {
	if len(sql) == 0 {
		return false
	}
	k := sqlText{unsafe.StringData(sql), len(sql)}
	for _, p := range st.plain {
		if p == k {
			return false
		}
	}
	if mayEnd = mayEndTx(sql); mayEnd || mentionsSessionSetting(sql) {
		// A statement that may end the transaction may also be one whose
		// text the scan does not see (EXECUTE, a prepared statement's
		// name): it may have set the session's lock_timeout.
		st.lockMs = 0
		return mayEnd
	}
	st.plain[st.plainNext%uint8(len(st.plain))] = k
	st.plainNext++
	return false
}

// sqlText is a string's identity: the address and length of its bytes.
type sqlText struct {
	p *byte
	n int
}

// mentionsSessionSetting reports whether sql contains "lock_timeout",
// "reset", "set_config" or "pg_settings" (whose setting may be a
// parameter or an expression), ASCII letters compared without case, or
// "u&" (a Unicode-escaped identifier or string may spell any name, U&"lock
// \005ftimeout"): one pass over sql that compares further only where an
// l, p, r, s or u starts (no allocation).
func mentionsSessionSetting(sql string) bool {
	for i := 0; i < len(sql); i++ {
		switch sql[i] | 0x20 {
		case 'l':
			if hasFoldAt(sql, i, "lock_timeout") {
				return true
			}
		case 'p':
			if hasFoldAt(sql, i, "pg_settings") {
				return true
			}
		case 'u':
			if i+1 < len(sql) && sql[i+1] == '&' {
				return true
			}
		case 'r':
			if hasFoldAt(sql, i, "reset") {
				return true
			}
		case 's':
			if hasFoldAt(sql, i, "set_config") {
				return true
			}
		}
	}
	return false
}

// hasFoldAt reports whether s[i:] starts with word (lower case), ASCII
// letters compared without case.
func hasFoldAt(s string, i int, word string) bool {
	if len(s)-i < len(word) {
		return false
	}
	for j := 1; j < len(word); j++ {
		c := s[i+j]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != word[j] {
			return false
		}
	}
	return true
}

// forgetStmt drops sql's statement alone.
func (st *connClaim) forgetStmt(sql string) {
	st.guardReady = ""
	for i, s := range st.stmts {
		if s.sql == sql {
			st.stmts = append(st.stmts[:i], st.stmts[i+1:]...)
			return
		}
	}
}

// errFallback: the statement's parameter types are not the encoded ones;
// the caller takes the pgx.Batch path.
var errFallback = errors.New("middleware: prepared claim not applicable")

// errPooled: the connection's server session is shared with other clients
// (42P05 on a name this connection never prepared); nothing was sent on
// the statement's behalf and no transaction is open.
var errPooled = errors.New("middleware: prepared claim behind a pooler")

// claimOIDs are the claim's parameter types, as encoded by connClaim.encode.
var claimOIDs = [5]uint32{oidText, oidUUID, oidTimestamptz, oidText, oidBytea}

// claimUnnamed sends BEGIN, the lock timeout and the claim p on pc as
// unnamed statements in one pgconn.Batch (one Sync: a pooler keeps it on
// one server connection), with the parameters encoded as the prepared
// claim's. It reports whether the claim inserted its row; on an error the
// caller rolls back.
func (b *pgxBeginner) claimUnnamed(ctx context.Context, conn *pgx.Conn, lockSQL string, p *processedstore.ClaimParams) (bool, error) {
	st := connClaimOf(conn.PgConn())
	vals := st.encode(p)
	var batch pgconn.Batch
	batch.ExecParams("begin", nil, nil, nil, nil)
	if lockSQL != "" {
		batch.ExecParams(lockSQL, nil, nil, nil, nil)
	}
	oids, formats := claimOIDs[:len(vals)], st.formats[:len(vals)]
	if p.ConsumerID != 0 {
		oids, formats = claimV7OIDs[:len(vals)], claimV7Formats[:len(vals)]
	}
	batch.ExecParams(p.SQL, vals, oids, formats, nil)
	return b.execClaimBatch(ctx, conn, &batch, lockSQL, p.SQL)
}

// sqlState is err's SQLSTATE, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// claimPrepared sends BEGIN, the lock timeout and the claim p on pc in one
// round trip (see the top of this file) and reports whether the claim
// inserted its row. errFallback (nothing sent) asks for the pgx.Batch path.
// On another error the transaction may be open or aborted: the caller rolls
// back, as on the pgx.Batch path.
func (b *pgxBeginner) claimPrepared(ctx context.Context, st *connClaim, conn *pgx.Conn, c *claimRequest, p *processedstore.ClaimParams) (bool, error) {
	pc := conn.PgConn()
	// The lock timeout is set before the claim, never only by a set_config
	// inside it: the executor takes the claim's lock on the claim table
	// before it evaluates any expression of the statement, so a setting in
	// the claim's WHERE would leave that wait unbounded (a LOCK TABLE, an
	// ALTER, a partition DROP holding the table;
	// TestLockTimeoutBoundsTheClaimTableLock). On a connection whose
	// session is its own (connClaim.sessionLock) it is the session's
	// setting, set once; otherwise the dialect's SET LOCAL, prepared too,
	// in the claim's batch.
	lockSQL := ""
	if c.lockTimeout != nil {
		if len(c.lockTimeout.args) != 0 {
			return false, errFallback
		}
		lockSQL = c.lockTimeout.query
	}
	types := claimTypes
	switch {
	case p.ConsumerID != 0 && p.Identity:
		types = claimV7IdentityTypes
	case p.ConsumerID != 0:
		types = claimV7Types
	case p.Identity:
		types = claimIdentityTypes
	}
	if b.pooled.Load() {
		return b.claimUnnamed(ctx, conn, lockSQL, p)
	}
	for try := 0; ; try++ {
		batchLock, claimSQL := lockSQL, p.SQL
		if lockSQL != "" && p.Pinned {
			// Only the lean claim (Pinned) can carry the backstop, so only
			// its lock timeout can be the session's.
			if st.lockClaims >= sessionLockRecheck {
				st.lockMs = 0
			}
			set, err := st.sessionLock(ctx, conn, c.lockTimeout.d)
			if err != nil {
				return false, err
			}
			b.noteSession(set)
			if set {
				batchLock = ""
				st.lockClaims++
				if p.SQLNear != "" && st.nearSkew(p, c.store.MaxFutureSkew()) {
					claimSQL = p.SQLNear
				}
				if st.raw {
					backstopped, ok := st.withLockBackstop(claimSQL, c.lockTimeout.d)
					if ok {
						claimSQL = backstopped
					} else {
						batchLock = lockSQL // not a lean claim: SET LOCAL after all
					}
				}
			}
		} else if c.lockTimeout == nil && st.changed {
			// LockTimeout < 0 leaves the session's lock_timeout as it
			// was before another consumer on this pool set it.
			if err := st.restoreSessionLock(ctx, conn); err != nil {
				return false, err
			}
		}
		// Preparing the claim takes the claim table's lock (its parse
		// analysis), outside any transaction: where the session's
		// lock_timeout is not the consumer's, the statements are prepared
		// inside a transaction that sets it, rolled back after (a
		// prepared statement outlives its transaction). Only when one is
		// missing: the first claim on a connection, or after a loss.
		bounded := false
		if batchLock != "" && (!st.has("begin") || !st.has(batchLock) || !st.has(claimSQL)) {
			if _, err := pc.Exec(ctx, "begin; "+batchLock).ReadAll(); err != nil {
				return false, err
			}
			bounded = true
		}
		begin, err := st.stmt(ctx, pc, "begin", nil)
		var lock preparedStmt
		if err == nil && batchLock != "" {
			lock, err = st.stmt(ctx, pc, batchLock, nil)
		}
		var claim preparedStmt
		if err == nil {
			claim, err = st.stmt(ctx, pc, claimSQL, types)
		}
		if bounded {
			if _, rerr := pc.Exec(ctx, "rollback").ReadAll(); rerr != nil {
				return false, errors.Join(err, rerr)
			}
		}
		if err == errPooled {
			b.pooled.Store(true)
			st.forget()
			return b.claimUnnamed(ctx, conn, lockSQL, p)
		}
		if err != nil {
			return false, err
		}
		if !begin.ok || (batchLock != "" && !lock.ok) || !claim.ok {
			return false, errFallback
		}
		vals := st.encode(p)
		if st.begunName != begin.name {
			st.begun = pgconn.Batch{}
			st.begun.ExecPrepared(begin.name, nil, nil, nil)
			st.begunName = begin.name
		}
		batch := st.begun
		if batchLock != "" {
			batch.ExecPrepared(lock.name, nil, nil, nil)
		}
		formats := st.formats[:len(vals)]
		if p.ConsumerID != 0 {
			formats = claimV7Formats[:len(vals)]
		}
		batch.ExecPrepared(claim.name, vals, formats, nil)
		claimed, err := b.execClaimBatch(ctx, conn, &batch, batchLock, claimSQL)
		if err == nil || !statementLost(err) || pc.IsClosed() {
			return claimed, err
		}
		// The connection lost our statements: end what the batch opened,
		// then prepare them again and resend, once. Those it still has
		// (one may have been lost alone) are dropped first, so preparing
		// them anew never meets their own name (42P05, the pooler's sign).
		if pc.TxStatus() != 'I' {
			if _, rerr := pc.Exec(ctx, "rollback").ReadAll(); rerr != nil {
				return false, errors.Join(err, rerr)
			}
		}
		if try == 0 {
			for _, s := range st.stmts {
				if derr := pc.Deallocate(ctx, s.name); derr != nil {
					return false, errors.Join(err, derr)
				}
			}
		}
		st.forget()
		if try > 0 {
			// Lost again right after they were prepared: the server
			// session changes under this connection (a transaction
			// pooler). Unnamed statements from now on, this attempt
			// included (it rolled back: nothing is claimed yet).
			b.pooled.Store(true)
			return b.claimUnnamed(ctx, conn, lockSQL, p)
		}
	}
}

// execClaimBatch sends batch and returns whether its last statement (the
// claim) inserted one row. With a pgx.BatchTracer on the pool, the batch
// is traced as pgx would trace a pgx.Batch of the same statements.
func (b *pgxBeginner) execClaimBatch(ctx context.Context, conn *pgx.Conn, batch *pgconn.Batch, lockSQL, claimSQL string) (bool, error) {
	var tb *pgx.Batch
	if b.tracer != nil {
		tb = &pgx.Batch{}
		tb.Queue("begin")
		if lockSQL != "" {
			tb.Queue(lockSQL)
		}
		tb.Queue(claimSQL)
		ctx = b.tracer.TraceBatchStart(ctx, conn, pgx.TraceBatchStartData{Batch: tb})
	}
	mrr := conn.PgConn().ExecBatch(ctx, batch)
	var tag pgconn.CommandTag
	i := 0
	for mrr.NextResult() {
		var err error
		tag, err = mrr.ResultReader().Close()
		if tb != nil {
			b.tracer.TraceBatchQuery(ctx, conn, pgx.TraceBatchQueryData{SQL: tb.QueuedQueries[i].SQL, CommandTag: tag, Err: err})
		}
		i++
	}
	err := mrr.Close()
	if tb != nil {
		b.tracer.TraceBatchEnd(ctx, conn, pgx.TraceBatchEndData{Err: err})
	}
	if err != nil {
		return false, err
	}
	n := 2
	if lockSQL != "" {
		n = 3
	}
	if i != n {
		return false, errors.New("middleware: prepared claim: " + strconv.Itoa(i) + " results for " + strconv.Itoa(n) + " statements")
	}
	return tag.RowsAffected() == 1, nil
}

// statementLost: the server does not know a statement the batch named
// (26000 invalid_sql_statement_name), by SQLSTATE.
func statementLost(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "26000"
}

// identityReadTypes are the stored-identity read's parameter types.
var identityReadTypes = [][]uint32{{oidText, oidVarchar}, {oidUUID}}

// identityReadOIDs are the read's parameter types as encoded.
var identityReadOIDs = []uint32{oidText, oidUUID}

// binaryResults asks for the stored identity's two columns in binary: the
// bytes of the text and of the bytea as stored.
var binaryResults = []int16{1, 1}

// readAndRollbackPrepared is readAndRollback after a prepared claim: query
// (processedstore.Store.StoredIdentityQuery, $1 consumer, $2 event id) and
// ROLLBACK as statements prepared once per connection, in one pgconn.Batch,
// the parameters encoded as the claim's (unnamed statements behind a
// pooler, pgxBeginner.pooled). errFallback (nothing sent, tx still open)
// asks for the pgx.Batch path.
//
// A read whose statement the server lost (26000) or can no longer run as
// prepared (0A000 "cached plan must not change result type": the table's
// columns changed since it was prepared, e.g. ALTER TABLE … TYPE) is
// dropped and read once more, unnamed, once the transaction ended: the row
// it reads is committed, and a statement of its own after the ROLLBACK
// takes a snapshot as new as the one in the transaction would have. The
// next duplicate prepares it again.
func (tx *pgxTx) readAndRollbackPrepared(ctx context.Context, query string, key identityKey, name, fp *[]byte) (found bool, err error) {
	pc := tx.pc.PgConn()
	st := tx.session
	named := tx.pooled == nil || !tx.pooled.Load()
	var read, rb preparedStmt
	if named {
		read, err = st.stmt(ctx, pc, query, identityReadTypes)
		if err == nil {
			rb, err = st.stmt(ctx, pc, "rollback", nil)
		}
		switch {
		case err == errPooled:
			tx.pooled.Store(true)
			st.forget()
			named = false
		case err != nil:
			tx.closed = true
			return false, tx.endAfterBatch(ctx, err)
		case !read.ok || !rb.ok:
			return false, errFallback
		}
	}
	tx.closed = true
	st.text[0] = append(st.text[0][:0], key.consumer...)
	st.vals[0] = st.text[0]
	st.uuid = key.eventID
	st.vals[1] = st.uuid[:]
	vals := st.vals[:2]
	var batch pgconn.Batch
	if named {
		batch.ExecPrepared(read.name, vals, st.formats[:2], binaryResults)
		batch.ExecPrepared(rb.name, nil, nil, nil)
	} else {
		batch.ExecParams(query, vals, identityReadOIDs, st.formats[:2], binaryResults)
		batch.ExecParams("rollback", nil, nil, nil, nil)
	}
	found, err = tx.execReadBatch(ctx, &batch, query, key, []string{query, "rollback"}, name, fp)
	err = tx.endAfterBatch(ctx, err)
	if named && statementInvalid(err) && !pc.IsClosed() && pc.TxStatus() == 'I' {
		// Drop it (a no-op when lost) so that the next duplicate prepares
		// it anew, then read once more, unnamed.
		_ = pc.Deallocate(ctx, read.name)
		st.forgetStmt(query)
		var again pgconn.Batch
		again.ExecParams(query, vals, identityReadOIDs, st.formats[:2], binaryResults)
		found, err = tx.execReadBatch(ctx, &again, query, key, []string{query}, name, fp)
	}
	return found, err
}

// execReadBatch sends batch (the stored-identity read first) and reads the
// identity of its first result into name and fp. It is an error when the
// batch did not return one result per entry of sqls (traced as a pgx.Batch
// of sqls).
func (tx *pgxTx) execReadBatch(ctx context.Context, batch *pgconn.Batch, query string, key identityKey, sqls []string, name, fp *[]byte) (found bool, err error) {
	var tb *pgx.Batch
	if tx.tracer != nil {
		tb = &pgx.Batch{}
		for _, q := range sqls {
			if q == query {
				tb.Queue(q, key.consumer, key.eventID)
			} else {
				tb.Queue(q)
			}
		}
		ctx = tx.tracer.TraceBatchStart(ctx, tx.pc, pgx.TraceBatchStartData{Batch: tb})
	}
	mrr := tx.pc.PgConn().ExecBatch(ctx, batch)
	results := 0
	for mrr.NextResult() {
		rr := mrr.ResultReader()
		if results == 0 {
			for rr.NextRow() {
				v := rr.Values()
				if len(v) == 2 {
					found = true
					*name = append((*name)[:0], v[0]...)
					*fp = nil
					if v[1] != nil {
						*fp = append([]byte(nil), v[1]...)
					}
				}
			}
		}
		tag, rerr := rr.Close()
		if tb != nil && results < len(tb.QueuedQueries) {
			tx.tracer.TraceBatchQuery(ctx, tx.pc, pgx.TraceBatchQueryData{SQL: tb.QueuedQueries[results].SQL, Args: tb.QueuedQueries[results].Arguments, CommandTag: tag, Err: rerr})
		}
		results++
	}
	err = mrr.Close()
	if tb != nil {
		tx.tracer.TraceBatchEnd(ctx, tx.pc, pgx.TraceBatchEndData{Err: err})
	}
	if err == nil && results != len(sqls) {
		err = errors.New("middleware: prepared duplicate read: " + strconv.Itoa(results) + " results for " + strconv.Itoa(len(sqls)) + " statements")
	}
	return found, err
}

// statementInvalid: a named statement the server lost (26000
// invalid_sql_statement_name) or can no longer run as prepared (0A000
// feature_not_supported, "cached plan must not change result type").
func statementInvalid(err error) bool {
	switch sqlState(err) {
	case "26000", "0A000":
		return true
	}
	return false
}
