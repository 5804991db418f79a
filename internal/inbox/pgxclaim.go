package inbox

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"

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

// preparedClaimKey is the key of the per-connection state in
// pgconn.PgConn.CustomData.
const preparedClaimKey = "github.com/watermill-idempotency/idempotency/middleware.preparedClaim"

// stmtSeq numbers the statements this process prepares ("idempotency_<n>"),
// so no two statements of the process share a name on one connection.
var stmtSeq atomic.Int64

// PostgreSQL type OIDs of the claim's parameters.
const (
	oidText        = 25
	oidVarchar     = 1043
	oidUUID        = 2950
	oidTimestamptz = 1184
	oidBytea       = 17
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
	stmts   []preparedStmt
	vals    [5][]byte
	formats [5]int16
	text    [2][]byte // consumer, event name
	uuid    [16]byte
	ts      [8]byte
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

// stmt returns sql's statement on pc, preparing it first when needed.
// types, when not nil, are the parameter types the statement must have
// (each entry: the accepted OIDs).
func (st *connClaim) stmt(ctx context.Context, pc *pgconn.PgConn, sql string, types [][]uint32) (preparedStmt, error) {
	for _, s := range st.stmts {
		if s.sql == sql {
			return s, nil
		}
	}
	s := preparedStmt{sql: sql, name: "idempotency_" + strconv.FormatInt(stmtSeq.Add(1), 10)}
	sd, err := pc.Prepare(ctx, s.name, sql, nil)
	if err != nil {
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
)

// microseconds from 1970-01-01 to 2000-01-01, PostgreSQL's epoch for the
// binary timestamptz.
const pgEpochMicros = 946684800 * 1000000

// encode fills the parameter buffers for p and returns the values.
func (st *connClaim) encode(p *processedstore.ClaimParams) [][]byte {
	st.text[0] = append(st.text[0][:0], p.Consumer...)
	st.vals[0] = st.text[0]
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
	st.text[1] = append(st.text[1][:0], p.EventName...)
	st.vals[3] = st.text[1]
	st.vals[4] = p.Fingerprint // nil: NULL, as pgx sends a nil []byte
	return st.vals[:5]
}

// forget drops the connection's statements (the server lost them).
func (st *connClaim) forget() { st.stmts = st.stmts[:0] }

// errFallback: the statement's parameter types are not the encoded ones;
// the caller takes the pgx.Batch path.
var errFallback = errors.New("middleware: prepared claim not applicable")

// claimPrepared sends BEGIN, the lock timeout and the claim p on pc in one
// round trip (see the top of this file) and reports whether the claim
// inserted its row. errFallback (nothing sent) asks for the pgx.Batch path.
// On another error the transaction may be open or aborted: the caller rolls
// back, as on the pgx.Batch path.
func (b *pgxBeginner) claimPrepared(ctx context.Context, conn *pgx.Conn, c *claimRequest, p *processedstore.ClaimParams) (bool, error) {
	pc := conn.PgConn()
	st := connClaimOf(pc)
	// The lock timeout is a statement of its own before the claim (the
	// dialect's SET LOCAL, prepared too), never only a set_config inside
	// the claim: the executor takes the claim's lock on the claim table
	// before it evaluates any expression of the statement, so a setting in
	// the claim's WHERE would leave that wait unbounded (a LOCK TABLE, an
	// ALTER, a partition DROP holding the table;
	// TestLockTimeoutBoundsTheClaimTableLock).
	lockSQL := ""
	if c.lockTimeout != nil {
		if len(c.lockTimeout.args) != 0 {
			return false, errFallback
		}
		lockSQL = c.lockTimeout.query
	}
	types := claimTypes
	if p.Identity {
		types = claimIdentityTypes
	}
	for try := 0; ; try++ {
		begin, err := st.stmt(ctx, pc, "begin", nil)
		if err != nil {
			return false, err
		}
		var lock preparedStmt
		if lockSQL != "" {
			if lock, err = st.stmt(ctx, pc, lockSQL, nil); err != nil {
				return false, err
			}
		}
		claim, err := st.stmt(ctx, pc, p.SQL, types)
		if err != nil {
			return false, err
		}
		if !begin.ok || (lockSQL != "" && !lock.ok) || !claim.ok {
			return false, errFallback
		}
		vals := st.encode(p)
		var batch pgconn.Batch
		batch.ExecPrepared(begin.name, nil, nil, nil)
		if lockSQL != "" {
			batch.ExecPrepared(lock.name, nil, nil, nil)
		}
		batch.ExecPrepared(claim.name, vals, st.formats[:len(vals)], nil)
		claimed, err := b.execClaimBatch(ctx, conn, &batch, lockSQL, p.SQL)
		if err == nil || !statementLost(err) || pc.IsClosed() {
			return claimed, err
		}
		if try > 0 {
			st.forget() // the next attempt prepares them again
			return claimed, lostStatement(err)
		}
		// The connection lost our statements: end what the batch opened,
		// then prepare them again and resend, once.
		if pc.TxStatus() != 'I' {
			if _, rerr := pc.Exec(ctx, "rollback").ReadAll(); rerr != nil {
				return false, errors.Join(err, rerr)
			}
		}
		st.forget()
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

// binaryResults asks for the stored identity's two columns in binary: the
// bytes of the text and of the bytea as stored.
var binaryResults = []int16{1, 1}

// readAndRollbackPrepared is readAndRollback after a prepared claim: query
// (processedstore.Store.StoredIdentityQuery, $1 consumer, $2 event id) and
// ROLLBACK as statements prepared once per connection, in one pgconn.Batch,
// the parameters encoded as the claim's. errFallback (nothing sent, tx
// still open) asks for the pgx.Batch path.
func (tx *pgxTx) readAndRollbackPrepared(ctx context.Context, query string, key identityKey, name, fp *[]byte) (found bool, err error) {
	pc := tx.pc.PgConn()
	st := connClaimOf(pc)
	read, err := st.stmt(ctx, pc, query, identityReadTypes)
	if err != nil {
		tx.closed = true
		return false, tx.endAfterBatch(ctx, err)
	}
	rb, err := st.stmt(ctx, pc, "rollback", nil)
	if err != nil {
		tx.closed = true
		return false, tx.endAfterBatch(ctx, err)
	}
	if !read.ok || !rb.ok {
		return false, errFallback
	}
	tx.closed = true
	st.text[0] = append(st.text[0][:0], key.consumer...)
	st.vals[0] = st.text[0]
	st.uuid = key.eventID
	st.vals[1] = st.uuid[:]
	var batch pgconn.Batch
	batch.ExecPrepared(read.name, st.vals[:2], st.formats[:2], binaryResults)
	batch.ExecPrepared(rb.name, nil, nil, nil)
	var tb *pgx.Batch
	if tx.tracer != nil {
		tb = &pgx.Batch{}
		tb.Queue(query, key.consumer, key.eventID)
		tb.Queue("rollback")
		ctx = tx.tracer.TraceBatchStart(ctx, tx.pc, pgx.TraceBatchStartData{Batch: tb})
	}
	mrr := pc.ExecBatch(ctx, &batch)
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
		if tb != nil {
			tx.tracer.TraceBatchQuery(ctx, tx.pc, pgx.TraceBatchQueryData{SQL: tb.QueuedQueries[results].SQL, Args: tb.QueuedQueries[results].Arguments, CommandTag: tag, Err: rerr})
		}
		results++
	}
	err = mrr.Close()
	if tb != nil {
		tx.tracer.TraceBatchEnd(ctx, tx.pc, pgx.TraceBatchEndData{Err: err})
	}
	if statementLost(err) {
		// The read's statement was lost since it was prepared (the claim's
		// were not): this attempt fails, transiently, and the next one
		// prepares it again.
		st.forget()
		err = lostStatement(err)
	}
	if err == nil && results != 2 {
		err = errors.New("middleware: prepared duplicate read: " + strconv.Itoa(results) + " results for 2 statements")
	}
	return found, tx.endAfterBatch(ctx, err)
}

// lostStatement is err, a statement of this file the connection does not
// know (26000), as what it is by origin: the attempt's connection lost the
// beginner's own statement (transient; the next attempt prepares it
// again), never a configuration error of the claim.
func lostStatement(err error) error {
	return &InfrastructureError{Op: "prepared statement lost", Err: err}
}
