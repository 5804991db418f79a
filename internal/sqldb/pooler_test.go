package sqldb_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/door"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Behind PgBouncer in transaction pooling that does not track named
// prepared statements (Debian's 1.18; 1.24 with max_prepared_statements
// 0), with other clients keeping its server connections changing hands,
// what the library runs on a user's pgx pool outside any transaction of
// the user's works in each of pgx's exec modes: the migrations
// (processed, family store), the table's replay
// horizon (set, read), the consumer's checks at start
// (middleware.NewConsumer), the crash count of counted attempts, and each run of processed.Purger and of the
// family purger, which deletes every expired row. The pool's exec mode
// is the user's choice (pgx's default, QueryExecModeCacheStatement,
// included) and these components share the pool. The exec modes of one
// pooler share its server connections, as services do.
func TestOwnStatementsRunBehindATransactionPoolerInEveryExecMode(t *testing.T) {
	t.Parallel()
	testenv.EachPoolerExecMode(t, testenv.TransactionPoolers[:2],
		func(t *testing.T, bouncer *testenv.PgBouncer) { bouncer.OtherClients(t, 4) },
		func(t *testing.T, bouncer *testenv.PgBouncer, _ testenv.PoolerSetup, mode pgx.QueryExecMode) {
			ownStatementsBehind(t, bouncer.PoolBehind(t, mode, 2))
		})
}

// ownStatementsBehind runs each component on pool (behind the pooler),
// each step a subtest of its own so that every failing one is reported.
func ownStatementsBehind(t *testing.T, pool *pgxpool.Pool) {
	ctx := context.Background()
	// PgBouncer forwards no search_path: tables are schema-qualified.
	schema := testenv.Schema(t)
	admin := testenv.PoolOn(t, schema, 2)
	db := idempotency.Pgx(pool)
	table := schema + ".processed_event"
	families, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{
		LatestTable: schema + ".family_latest", AppliedTable: schema + ".family_applied"})
	require.NoError(t, err)
	const rounds = 3

	// The outbox's and the operation runner's Migrate run the same
	// sqldb.MigrateTable on the same querier.
	migrated := t.Run("Migrate", func(t *testing.T) {
		require.NoError(t, processed.Migrate(ctx, db, processed.Config{Table: table}))
		require.NoError(t, families.Migrate(ctx, db))
	})
	if !migrated { // the rest on tables migrated directly
		require.NoError(t, processed.Migrate(ctx, idempotency.Pgx(admin), processed.Config{Table: table}))
		require.NoError(t, families.Migrate(ctx, idempotency.Pgx(admin)))
	}

	horizon := t.Run("ReplayHorizon", func(t *testing.T) {
		require.NoError(t, processed.SetReplayHorizon(ctx, db, table, time.Hour))
		for i := 0; i < rounds; i++ {
			got, err := processed.ReplayHorizon(ctx, db, table)
			require.NoError(t, err)
			require.Equal(t, time.Hour, got)
		}
	})
	if !horizon {
		require.NoError(t, processed.SetReplayHorizon(ctx, idempotency.Pgx(admin), table, time.Hour))
	}

	t.Run("NewConsumer", func(t *testing.T) {
		for i := 0; i < rounds; i++ {
			_, err := middleware.NewConsumer(middleware.ConsumerConfig{
				Consumer: fmt.Sprint("c", i), DB: db, Table: table, ReplayHorizon: time.Hour,
				Poison: middleware.PoisonConfig{Publisher: nopPublisher{}, Topic: "poison"},
			}, nil)
			require.NoError(t, err)
		}
	})

	// The crash count of counted attempts (redeliveries) runs beside the
	// claim on the pool: every start gets its end, nothing is logged.
	t.Run("CrashCount", func(t *testing.T) {
		logger := watermill.NewCaptureLogger()
		c, err := middleware.NewConsumer(middleware.ConsumerConfig{
			Consumer: "counted", DB: db, Table: table, ReplayHorizon: time.Hour,
			Poison: middleware.PoisonConfig{Publisher: nopPublisher{}, Topic: "poison"},
		}, logger)
		require.NoError(t, err)
		h, err := door.Wrap(c, "counted", func(*message.Message) ([]*message.Message, error) { return nil, nil })
		require.NoError(t, err)
		for i := 0; i < 3*rounds; i++ {
			msg, err := marshaler.NewMessage("order.placed", map[string]int{"n": i})
			require.NoError(t, err)
			marshaler.SetRedelivered(msg, true) // a counted attempt
			_, err = h(msg)
			require.NoError(t, err)
		}
		var left int
		require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+table+`_crash`).Scan(&left))
		require.Zero(t, left, "counted starts without their end")
		for _, e := range logger.Captured()[watermill.ErrorLogLevel] {
			t.Errorf("logged at ERROR: %s: %v", e.Msg, e.Err)
		}
	})

	t.Run("processed.Purger", func(t *testing.T) {
		p, err := processed.NewPurger(processed.PurgerConfig{DB: db, Table: table, BatchSize: 4}, nil)
		require.NoError(t, err)
		for i := 0; i < rounds; i++ {
			_, err := admin.Exec(ctx, `INSERT INTO `+table+` (consumer, event_id, event_at)
SELECT 'c', gen_random_uuid(), now() - interval '2 hours' FROM generate_series(1, 10)`)
			require.NoError(t, err)
			n, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran, "no other purger runs")
			require.EqualValues(t, 10, n)
		}
	})

	t.Run("versioned.FamilyPurger", func(t *testing.T) {
		p, err := versioned.NewFamilyPurger(families, db, versioned.FamilyPurgerConfig{Horizon: time.Hour, BatchSize: 2}, nil)
		require.NoError(t, err)
		for i := 0; i < rounds; i++ {
			for j := 0; j < 3; j++ {
				_, err := families.Advance(ctx, sqldb.Pgx(admin), versioned.Family{Kind: "k", ID: fmt.Sprint(i*10 + j)},
					versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
				require.NoError(t, err)
			}
			_, err := admin.Exec(ctx, `UPDATE `+schema+`.family_latest SET updated_at = now() - interval '2 hours'`)
			require.NoError(t, err)
			_, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran, "no other purger runs")
			var left int
			require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.family_latest`).Scan(&left))
			require.Zero(t, left)
		}
	})
}

// nopPublisher is the consumer's poison publisher; nothing is poisoned.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }
