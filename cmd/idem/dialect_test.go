package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// TestOtherDialects runs processed show, purge --dry-run and operations
// list/resolve on MySQL/MariaDB and SQLite through the same sqldb seam.
func TestOtherDialects(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "shop.db")
		dsn := testenv.SQLiteDSN(path)
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		dialectCase(t, db, sqldb.SQLite, "sqlite", dsn,
			`INSERT INTO processed_event (consumer, event_id, processed_at, event_at) VALUES (?, ?, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 days'), strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-3 days'))`)
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		db := testenv.MySQLDB(t)
		var name string
		if err := db.QueryRow(`SELECT DATABASE()`).Scan(&name); err != nil {
			t.Fatal(err)
		}
		dialectCase(t, db, sqldb.MySQL, "mysql", testenv.MySQLDSN()+name,
			`INSERT INTO processed_event (consumer, event_id, processed_at, event_at) VALUES (?, ?, UTC_TIMESTAMP(6) - INTERVAL 3 DAY, UTC_TIMESTAMP(6) - INTERVAL 3 DAY)`)
	})
}

func dialectCase(t *testing.T, db *sql.DB, d sqldb.Dialect, dialect, dsn, insertOld string) {
	ctx := context.Background()
	q := sqldb.Std(db)
	store, err := processedstore.NewStore(processedstore.Config{Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, q); err != nil {
		t.Fatal(err)
	}
	id, old := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Claim(ctx, sqldb.Std(tx), "stock", id); err != nil {
		_ = tx.Rollback()
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, insertOld, "stock", old[:]); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) result {
		var out, errb bytes.Buffer
		code := RunContext(ctx, append(args, "--dialect", dialect, "--database-url", dsn), &out, &errb)
		t.Logf("idem %s → %d\n%s%s", strings.Join(args, " "), code, out.String(), errb.String())
		return result{code, out.String(), errb.String()}
	}

	r := run("processed", "show", strings.ToUpper(id.String()), "--json")
	wantCode(t, r, exitOK)
	if p := decode[processedShow](t, r); len(p.Records) != 1 || p.Records[0].Consumer != "stock" {
		t.Fatalf("show: %+v", p)
	}
	wantCode(t, run("processed", "show", uuid.NewString()), exitNotFound)

	r = run("purge", "--dry-run", "--horizon", "48h", "--json")
	wantCode(t, r, exitOK)
	if p := decode[purgePreview](t, r); p.Rows != 2 || p.ToDelete != 1 {
		t.Fatalf("purge preview: %+v", p)
	}

	runner, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, d)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := runner.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	k := operation.MustKey("charge", "order-1")
	_, _ = runner.Do(ctx, k, charge{"order-1", 1}, func(context.Context, string) (operation.Result, error) {
		return operation.Result{}, operation.Timeout(errors.New("timeout"))
	})
	r = run("operations", "list", "--json")
	wantCode(t, r, exitOK)
	if l := decode[struct{ Operations []operationRow }](t, r); len(l.Operations) != 1 || l.Operations[0].Key != k.String() {
		t.Fatalf("list: %+v", l)
	}
	wantCode(t, run("operations", "resolve", k.String(), "--succeeded", "ch_1", "--by", "alice"), exitOK)
	if rec, err := runner.Get(ctx, k); err != nil || rec.State != operation.StateSucceeded || rec.Reference != "ch_1" {
		t.Fatalf("record: %+v %v", rec, err)
	}
	wantCode(t, run("operations", "resolve", k.String(), "--failed", "x"), exitRefused)
}

func TestMissingTableMySQL(t *testing.T) {
	t.Parallel()
	db := testenv.MySQLDB(t)
	var name string
	if err := db.QueryRow(`SELECT DATABASE()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	code := RunContext(context.Background(), []string{"processed", "show", uuid.NewString(), "--dialect", "mysql", "--database-url", testenv.MySQLDSN() + name}, &out, &errb)
	if code != exitFailed || !strings.Contains(errb.String(), "processed_event does not exist") {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
}

// TestMySQLTimesWhateverTheDSNLocation: MySQL DATETIME columns hold UTC
// (UTC_TIMESTAMP), so the times idem shows are the same whatever
// location the DSN names for the driver (loc=Local is common in service
// DSNs; here a zone 9 hours from UTC): processed_at and the database
// clock are those of the server in UTC.
func TestMySQLTimesWhateverTheDSNLocation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testenv.MySQLDB(t)
	var name string
	if err := db.QueryRow(`SELECT DATABASE()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, sqldb.Std(db)); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	if _, err := db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id) VALUES ('stock', ?)`, id[:]); err != nil {
		t.Fatal(err)
	}
	var at time.Time // loc=UTC: the stored UTC value
	if err := db.QueryRowContext(ctx, `SELECT processed_at FROM processed_event`).Scan(&at); err != nil {
		t.Fatal(err)
	}
	for _, dsn := range []string{testenv.MySQLDSN() + name + "?parseTime=true&loc=Asia%2FTokyo", testenv.MySQLDSN() + name + "?loc=Asia%2FTokyo"} {
		var out, errb bytes.Buffer
		code := RunContext(ctx, []string{"processed", "show", id.String(), "--json", "--dialect", "mysql", "--database-url", dsn}, &out, &errb)
		if code != exitOK {
			t.Fatalf("%s: exit %d: %s", dsn, code, errb.String())
		}
		var s processedShow
		if err := json.Unmarshal(out.Bytes(), &s); err != nil || len(s.Records) != 1 {
			t.Fatalf("%s: %v %s", dsn, err, out.String())
		}
		if s.Records[0].ProcessedAt == nil {
			t.Fatalf("%s: processed_at null, stored (UTC) %s", dsn, at)
		}
		if got := time.Time(*s.Records[0].ProcessedAt); !got.Equal(at) {
			t.Fatalf("%s: processed_at %s, stored (UTC) %s", dsn, got.UTC(), at)
		}
	}
}

// TestUnreachableDatabaseHidesThePassword: the error naming an unreachable
// database never shows its password, whatever the form of the DSN (a URL,
// a go-sql-driver/mysql DSN, PostgreSQL keywords).
func TestUnreachableDatabaseHidesThePassword(t *testing.T) {
	t.Parallel()
	for _, c := range [][]string{
		{"postgres", "postgres://alice:s3cr3t-pw@127.0.0.1:1/shop?connect_timeout=2"},
		{"mysql", "alice:s3cr3t-pw@tcp(127.0.0.1:1)/shop"},
		{"postgres", "host=127.0.0.1 port=1 user=alice password=s3cr3t-pw dbname=shop connect_timeout=2"},
	} {
		var out, errb bytes.Buffer
		code := RunContext(context.Background(), []string{"processed", "show", uuid.NewString(), "--dialect", c[0], "--database-url", c[1]}, &out, &errb)
		if code != exitFailed || strings.Contains(errb.String()+out.String(), "s3cr3t") {
			t.Fatalf("%s: exit %d, stderr %q: want exit %d without the password", c[1], code, errb.String(), exitFailed)
		}
	}
}
