package sqldb_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Each component's Migrate records its versions beside the tables it
// creates (in their schema, not the search_path's): after the schema is
// dropped and created again, Migrate creates every table again. The
// connection's search_path is another schema, so a record kept there (the
// outbox's, before) would survive the drop and Migrate would create
// nothing (the relay then failed with 42P01 forever).
func TestMigrateRecreatesDroppedSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	home := testenv.Schema(t) // the search_path: where an unqualified record would go
	pool, err := pgxpool.New(ctx, testenv.SchemaURL(home))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	q := sqldb.Pgx(pool)

	components := []struct {
		name    string
		tables  []string
		migrate func(schema string) error
	}{
		{"processed", []string{"processed_event"}, func(s string) error {
			st, err := processedstore.NewStore(processedstore.Config{Table: s + ".processed_event"})
			if err != nil {
				return err
			}
			return st.Migrate(ctx, q)
		}},
		{"operation", []string{"operation"}, func(s string) error {
			r, err := operation.NewRunner(operation.Config{DB: idempotency.Pgx(pool), Table: s + ".operation"}, nil)
			if err != nil {
				return err
			}
			return r.Migrate(ctx)
		}},
		{"versioned", []string{"latest", "applied"}, func(s string) error {
			st, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: s + ".latest", AppliedTable: s + ".applied"})
			if err != nil {
				return err
			}
			return st.Migrate(ctx, idempotency.Pgx(pool))
		}},
		{"outbox", []string{"outbox", "outbox_dead", "outbox_relayed", "outbox_relay"}, func(s string) error {
			ob, err := outbox.New(outbox.Config{Table: s + ".outbox", DB: idempotency.Pgx(pool)}, nil)
			if err != nil {
				return err
			}
			return ob.Migrate(ctx)
		}},
	}
	for _, c := range components {
		t.Run(c.name, func(t *testing.T) {
			schema := testenv.UniqueName("recreate_" + c.name)
			t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`) })
			count := func() int {
				var n int
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = ANY($2)`, schema, c.tables).Scan(&n))
				return n
			}
			_, err := pool.Exec(ctx, `CREATE SCHEMA "`+schema+`"`)
			require.NoError(t, err)
			require.NoError(t, c.migrate(schema))
			require.Equal(t, len(c.tables), count())
			var records int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".idempotency_migration`).Scan(&records))
			require.NotZero(t, records, "the versions are recorded beside the tables")

			_, err = pool.Exec(ctx, `DROP SCHEMA "`+schema+`" CASCADE; CREATE SCHEMA "`+schema+`"`)
			require.NoError(t, err)
			require.NoError(t, c.migrate(schema))
			require.Equal(t, len(c.tables), count(), "Migrate recreated every table")

			// A table dropped alone (its schema kept, and with it the
			// records) is created again too.
			_, err = pool.Exec(ctx, `DROP TABLE "`+schema+`"."`+c.tables[0]+`" CASCADE`)
			require.NoError(t, err)
			require.NoError(t, c.migrate(schema))
			require.Equal(t, len(c.tables), count(), "Migrate recreated the dropped table")
		})
	}
}

// The same on MariaDB, where a schema is a database: each component's
// tables in a database other than the connection's, which is dropped and
// created again.
func TestMigrateRecreatesDroppedDatabaseMySQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.MySQLDB(t) // the connection's database: where an unqualified record would go
	q := sqldb.Std(db)
	components := []struct {
		name    string
		tables  []string
		migrate func(schema string) error
	}{
		{"processed", []string{"processed_event"}, func(s string) error {
			st, err := processedstore.NewStore(processedstore.Config{Table: s + ".processed_event", Dialect: sqldb.MySQL})
			if err != nil {
				return err
			}
			return st.Migrate(ctx, q)
		}},
		{"operation", []string{"operation"}, func(s string) error {
			r, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.MySQL), Table: s + ".operation"}, nil)
			if err != nil {
				return err
			}
			return r.Migrate(ctx)
		}},
		{"versioned", []string{"latest", "applied"}, func(s string) error {
			st, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{LatestTable: s + ".latest", AppliedTable: s + ".applied", Dialect: sqldb.MySQL})
			if err != nil {
				return err
			}
			return st.Migrate(ctx, idempotency.SQL(db, idempotency.MySQL))
		}},
		{"outbox", []string{"outbox", "outbox_dead", "outbox_relayed", "outbox_relay"}, func(s string) error {
			ob, err := outbox.New(outbox.Config{Table: s + ".outbox", DB: idempotency.SQL(db, idempotency.MySQL)}, nil)
			if err != nil {
				return err
			}
			return ob.Migrate(ctx)
		}},
	}
	for _, c := range components {
		t.Run(c.name, func(t *testing.T) {
			schema := testenv.UniqueName("recreate_" + c.name)
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+schema) })
			count := func() int {
				n := 0
				for _, table := range c.tables {
					var k int
					require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?`, schema, table).Scan(&k))
					n += k
				}
				return n
			}
			_, err := db.ExecContext(ctx, "CREATE DATABASE "+schema)
			require.NoError(t, err)
			require.NoError(t, c.migrate(schema))
			require.Equal(t, len(c.tables), count())
			_, err = db.ExecContext(ctx, "DROP DATABASE "+schema)
			require.NoError(t, err)
			_, err = db.ExecContext(ctx, "CREATE DATABASE "+schema)
			require.NoError(t, err)
			require.NoError(t, c.migrate(schema))
			require.Equal(t, len(c.tables), count(), "Migrate recreated every table")
		})
	}
}
