package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// Floors of the counts part (issue 25): the claim's mechanism measured in
// the same run as the middleware, so the server count per claim stands
// beside what any claim of that shape costs. Each floor variant sends BEGIN
// and its claim statement (both prepared once) in one batch, as the pgx
// beginner does, runs the handler on the same connection and commits
// through pgconn; the connection's session lock_timeout is the floors'
// (floorLockTimeout), as the pgx beginner keeps it. vFloorNone sends BEGIN alone: a floor's server count per
// claim is the variant's minus vFloorNone's. None has the chain's layers,
// payload verification, a lock on a duplicate's row or a crash bound: they
// price a statement, not a consumer.
const (
	vFloorNone      = "floor_none"
	vFloorMechanism = "floor_mechanism" // uuid-only INSERT … ON CONFLICT DO NOTHING
	vFloorChecked   = "floor_checked"   // a table per consumer: uuid and fingerprint, with every check of today's claim
	vFloorLean      = "floor_lean"      // issue 25's lean row with every check of today's claim
	vFloorToday     = "floor_today"     // the table's claim statement (the previous release's; ids of other versions)
	// The same rows with the lock bound per session only (issue 25's
	// proposal): the window, no backstop in the statement.
	vFloorCheckedSession = "floor_checked_session"
	vFloorLeanSession    = "floor_lean_session"
	vFloorTodaySession   = "floor_today_session"
)

// floorTodaySchema copies the migrated processed_event (columns, defaults,
// indexes, migration 0007's nullable event_at) for vFloorToday.
const floorTodaySchema = `CREATE TABLE floor_today (LIKE processed_event INCLUDING ALL)`

// floorSchema creates the floors' claim tables: floor_uuid, the event id
// alone; floor_checked, a table per consumer (issue 25's stretch): the
// event id and the fingerprint; floor_lean, issue 25's proposal: a
// small-integer consumer key, the UUIDv7 event id, the fingerprint, no
// secondary index.
const floorSchema = floorUUIDSchema + `
CREATE TABLE floor_checked (event_id uuid PRIMARY KEY, fingerprint bytea NOT NULL);
CREATE TABLE floor_lean (consumer int2 NOT NULL, event_id uuid NOT NULL, fingerprint bytea NOT NULL, PRIMARY KEY (consumer, event_id));
`

// floorUUIDSchema is floor_uuid, the mechanism's table (vFloorMechanism),
// in the counts part's schema and the overhead part's.
const floorUUIDSchema = `
CREATE TABLE floor_uuid (event_id uuid PRIMARY KEY);`

// floorLockTimeout is the floors' lock timeout, the session's setting on
// the floors' connection as the pgx beginner keeps it (sessionLock).
const floorLockTimeout = 5 * time.Second

// floorClaim is a floor's claim: INSERT INTO table (cols) SELECT sel with
// today's replay window on the database clock (1 h horizon, 5 min skew)
// on the event time at parameter ts and, when backstop, today's lock
// bound in the statement (processedstore.LeanClaimWithLockTimeout, the
// same text the middleware sends).
func floorClaim(table, cols, sel string, ts int, backstop bool) string {
	q := fmt.Sprintf("INSERT INTO %s (%s)\nSELECT %s\nWHERE ($%d::timestamptz BETWEEN statement_timestamp() - interval '3600000000 microseconds' AND statement_timestamp() + interval '300000000 microseconds')\nON CONFLICT DO NOTHING",
		table, cols, sel, ts)
	if backstop {
		var ok bool
		if q, ok = processedstore.LeanClaimWithLockTimeout(q, floorLockTimeout); !ok {
			panic("bench: floor claim without the lean claim's WHERE")
		}
	}
	return q
}

// floorClaims are the floors' claim statements.
var floorClaims = map[string]string{
	vFloorMechanism:      `INSERT INTO floor_uuid (event_id) VALUES ($1) ON CONFLICT DO NOTHING`,
	vFloorChecked:        floorClaim("floor_checked", "event_id, fingerprint", "$1, $2", 3, true),
	vFloorCheckedSession: floorClaim("floor_checked", "event_id, fingerprint", "$1, $2", 3, false),
	vFloorLean:           floorClaim("floor_lean", "consumer, event_id, fingerprint", "$1, $2, $3", 4, true),
	vFloorLeanSession:    floorClaim("floor_lean", "consumer, event_id, fingerprint", "$1, $2, $3", 4, false),
	// The statement the middleware sends for a UUIDv7 event with payload
	// verification (postgresLeanClaim with LeanClaimWithLockTimeout).
	vFloorToday:        floorClaim("floor_today", "consumer, event_id, event_name, fingerprint", "$1, $2, $5, $3", 4, true),
	vFloorTodaySession: floorClaim("floor_today", "consumer, event_id, event_name, fingerprint", "$1, $2, $5, $3", 4, false),
}

// isFloor reports whether v is a floor variant.
func isFloor(v string) bool { return v == vFloorNone || floorClaims[v] != "" }

// floorTx is the handler's transaction in a floor variant: Exec on the
// connection the batch began; the bench handler calls nothing else.
type floorTx struct {
	pgx.Tx
	conn *pgx.Conn
}

func (t floorTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}

// pgEpoch is PostgreSQL's binary timestamp origin.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// floorHandler returns h behind the floor variant v on conn.
func floorHandler(ctx context.Context, conn *pgx.Conn, v string, h message.HandlerFunc) (message.HandlerFunc, error) {
	pc := conn.PgConn()
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = '%dms'", floorLockTimeout.Milliseconds())); err != nil {
		return nil, err
	}
	if _, err := pc.Prepare(ctx, "floor_begin", "begin", nil); err != nil {
		return nil, err
	}
	claim := floorClaims[v]
	if claim != "" {
		if _, err := pc.Prepare(ctx, "floor_claim", claim, nil); err != nil {
			return nil, err
		}
	}
	formats := []int16{1, 1, 1, 1, 1}
	consumer := binary.BigEndian.AppendUint16(nil, 1)
	if v == vFloorToday || v == vFloorTodaySession {
		consumer = []byte(consumerName)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		id, err := uuid.Parse(msg.UUID)
		if err != nil {
			return nil, err
		}
		batch := &pgconn.Batch{}
		batch.ExecPrepared("floor_begin", nil, nil, nil)
		switch v {
		case vFloorMechanism:
			batch.ExecPrepared("floor_claim", [][]byte{id[:]}, formats[:1], nil)
		case vFloorNone:
		default:
			at, _ := processedstore.EventTime(id, time.Now())
			fp := processedstore.NewIdentity(eventName, msg.Payload).FingerprintBytes()
			us := binary.BigEndian.AppendUint64(nil, uint64(at.Sub(pgEpoch).Microseconds()))
			params := [][]byte{consumer, id[:], fp, us}
			if v == vFloorChecked || v == vFloorCheckedSession {
				params = params[1:]
			}
			if v == vFloorToday || v == vFloorTodaySession {
				params = append(params, []byte(eventName))
			}
			batch.ExecPrepared("floor_claim", params, formats[:len(params)], nil)
		}
		return runFloorTx(msg, conn, batch, claim != "", v, h)
	}, nil
}

// runFloorTx sends batch (BEGIN, and the claim when claimed) on conn,
// runs h in that transaction (floorTx) and commits; it rolls back when the
// claim inserted nothing or h fails.
func runFloorTx(msg *message.Message, conn *pgx.Conn, batch *pgconn.Batch, claimed bool, v string, h message.HandlerFunc) ([]*message.Message, error) {
	ctx, pc := msg.Context(), conn.PgConn()
	results, err := pc.ExecBatch(ctx, batch).ReadAll()
	if err != nil {
		return nil, err
	}
	if claimed && results[1].CommandTag.RowsAffected() != 1 {
		_, _ = pc.Exec(ctx, "rollback").ReadAll()
		return nil, fmt.Errorf("bench: %s: event %s claimed already", v, msg.UUID)
	}
	msg.SetContext(context.WithValue(ctx, benchTxKey{}, pgx.Tx(floorTx{conn: conn})))
	defer msg.SetContext(ctx)
	out, err := h(msg)
	if err != nil {
		_, _ = pc.Exec(ctx, "rollback").ReadAll()
		return nil, err
	}
	if _, err := pc.Exec(ctx, "commit").ReadAll(); err != nil {
		return nil, err
	}
	return out, nil
}

// mechanismClaim is the claim's mechanism alone (vFloorMechanism) as a
// variant of the overhead part, the generic floor of the claim's rate
// ratio measured in the same rounds: per message a pooled connection,
// BEGIN and the uuid-only INSERT … ON CONFLICT DO NOTHING into floor_uuid
// (both prepared once per connection) in one batch, the handler on that
// connection, COMMIT. It has no consumer key, window, fingerprint, lock
// bound or crash bound: it prices what any claim row costs.
func mechanismClaim(pool *pgxpool.Pool) message.HandlerMiddleware {
	const prepared = "bench_floor_mechanism"
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			id, err := uuid.Parse(msg.UUID)
			if err != nil {
				return nil, err
			}
			c, err := pool.Acquire(ctx)
			if err != nil {
				return nil, err
			}
			defer c.Release()
			conn := c.Conn()
			pc := conn.PgConn()
			if pc.CustomData()[prepared] == nil {
				if _, err := pc.Prepare(ctx, "floor_begin", "begin", nil); err != nil {
					return nil, err
				}
				if _, err := pc.Prepare(ctx, "floor_claim", floorClaims[vFloorMechanism], nil); err != nil {
					return nil, err
				}
				pc.CustomData()[prepared] = true
			}
			batch := &pgconn.Batch{}
			batch.ExecPrepared("floor_begin", nil, nil, nil)
			batch.ExecPrepared("floor_claim", [][]byte{id[:]}, []int16{1}, nil)
			return runFloorTx(msg, conn, batch, true, vFloorMechanism, h)
		}
	}
}
