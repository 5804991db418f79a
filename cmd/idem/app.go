package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/go-sql-driver/mysql" // also the database/sql driver "mysql"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	_ "modernc.org/sqlite"             // database/sql driver "sqlite"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/operation"
)

// Exit codes of every command (also printed by "idem help").
const (
	exitOK       = 0 // done; for "processed show": the event was applied
	exitUsage    = 1 // bad usage or input: unknown command or flag, malformed id, key, time or duration
	exitNotFound = 2 // what was asked for does not exist: event not applied, queue, message or operation unknown
	exitRefused  = 3 // refused, nothing changed: wrong state, fingerprint mismatch, operation in progress elsewhere
	exitFailed   = 4 // the database or the broker failed (unreachable, missing table, publish not confirmed)
)

// Defaults of the connection settings: the demo's (examples/demo).
const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
	connectTimeout     = 10 * time.Second
)

const exitCodesHelp = `Exit codes:
  0  ok (processed show: the event was applied)
  1  usage or bad input (unknown command or flag, malformed event id, key, time, duration)
  2  not found (event not applied by the consumer(s), unknown queue, message or operation key)
  3  refused, nothing changed (final or wrong state, fingerprint mismatch, in progress elsewhere)
  4  database or broker failure (unreachable, missing table, publish not confirmed)
`

const usageText = `usage: idem COMMAND [flags]

Commands:
  processed show EVENT_ID [--consumer C]          was the event applied, when, by which consumer
  dlq list QUEUE [--limit N]                      dead-lettered messages (never the payload)
  dlq show QUEUE EVENT_ID [--payload]             one dead-lettered message in detail
  dlq redrive QUEUE (--event-id ID ... | --all) [--dry-run] [--to QUEUE] [--window N] [--progress N]
                                                  move dead letters back to their queue (copy
                                                  confirmed before the dead letter is acked)
  outbox replay --from T1 --to T2 [--topic T ...] [--dry-run] [--exchange E]
                                                  republish outbox events of [T1, T2) with their ids
  outbox redrive (--event-id ID ... | --topic T ... | --all) [--dry-run]
                                                  move dead-lettered outbox rows back to pending
                                                  (attempts reset; the relay publishes them)
  operations list [--state S] [--limit N]         operation records (default: uncertain)
  operations resolve KEY (--succeeded REF | --failed REASON | --not-executed REASON)
                     [--by NAME] [--fingerprint F] [--note TEXT]
                                                  record a person's verdict on an uncertain operation
  purge --dry-run [--horizon D]                   what the purger would delete now

Common flags (any command):
  --database-url URL   $DATABASE_URL, default ` + defaultDatabaseURL + `
                       (add search_path=SCHEMA to the query for another schema)
  --dialect D          postgres (default), mysql (go-sql-driver DSN) or sqlite (file DSN); $IDEM_DIALECT
  --amqp-url URL       $AMQP_URL, default ` + defaultAMQPURL + `
  --processed-table T  default ` + processedstore.DefaultTable + `
  --operations-table T default ` + operation.DefaultTable + `
  --json               one JSON document on stdout instead of a table

` + exitCodesHelp

// cliError is an error with the exit code it maps to.
type cliError struct {
	code int
	err  error
}

func (e *cliError) Error() string { return e.err.Error() }
func (e *cliError) Unwrap() error { return e.err }

func withCode(code int, format string, args ...any) error {
	return &cliError{code: code, err: fmt.Errorf(format, args...)}
}

func usageErr(format string, args ...any) error    { return withCode(exitUsage, format, args...) }
func notFoundErr(format string, args ...any) error { return withCode(exitNotFound, format, args...) }
func refusedErr(format string, args ...any) error  { return withCode(exitRefused, format, args...) }
func failedErr(format string, args ...any) error   { return withCode(exitFailed, format, args...) }

// codeOf maps err to an exit code: a cliError's own, exitFailed otherwise.
func codeOf(err error) int {
	var c *cliError
	if errors.As(err, &c) {
		return c.code
	}
	var q quietError
	if errors.As(err, &q) {
		return q.code
	}
	return exitFailed
}

// Run runs one idem command with args (without the program name), writing
// its output to stdout and diagnostics to stderr, and returns the exit code.
// SIGINT and SIGTERM cancel the command's context (a redrive stops between
// two messages, with nothing lost).
func Run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return RunContext(ctx, args, stdout, stderr)
}

// RunContext is Run with the caller's context.
func RunContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	err := dispatch(ctx, args, stdout, stderr)
	if err == nil {
		return exitOK
	}
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	var q quietError
	if !errors.As(err, &q) {
		fmt.Fprintln(stderr, "idem: "+oneLine(err.Error()))
	}
	return codeOf(err)
}

// quietError carries an exit code whose explanation was already printed
// (processed show: "not applied" is in the output).
type quietError struct{ code int }

func (q quietError) Error() string { return fmt.Sprintf("exit %d", q.code) }

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

type command struct {
	name  string
	usage string
	run   func(ctx context.Context, e *env, args []string) error
}

var commands = []command{
	{"processed show", "processed show EVENT_ID [--consumer C]", runProcessedShow},
	{"dlq list", "dlq list QUEUE [--limit N]", runDLQList},
	{"dlq show", "dlq show QUEUE EVENT_ID [--payload]", runDLQShow},
	{"dlq redrive", "dlq redrive QUEUE (--event-id ID ... | --all) [--dry-run] [--to QUEUE] [--exchange E] [--window N] [--progress N]", runDLQRedrive},
	{"outbox replay", "outbox replay --from T1 --to T2 [--topic T] [--dry-run]", runOutboxReplay},
	{"outbox redrive", "outbox redrive (--event-id ID ... | --topic T ... | --all) [--dry-run]", runOutboxRedrive},
	{"operations list", "operations list [--state S] [--limit N]", runOperationsList},
	{"operations resolve", "operations resolve KEY (--succeeded REF | --failed REASON | --not-executed REASON) [--by NAME] [--fingerprint F] [--note TEXT]", runOperationsResolve},
	{"purge", "purge --dry-run [--horizon D]", runPurge},
}

func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
		fmt.Fprint(stdout, usageText)
		if len(args) == 0 {
			return usageErr("no command (see above)")
		}
		return nil
	}
	for _, c := range commands {
		words := strings.Fields(c.name)
		if len(args) < len(words) || strings.Join(args[:len(words)], " ") != c.name {
			continue
		}
		e := &env{stdout: stdout, stderr: stderr, cmd: c}
		return c.run(ctx, e, args[len(words):])
	}
	return usageErr("unknown command %q (run \"idem help\")", strings.Join(args[:min(2, len(args))], " "))
}

// env is one command's settings and outputs.
type env struct {
	stdout, stderr io.Writer
	cmd            command

	databaseURL     string
	dialectName     string
	amqpURL         string
	processedTable  string
	operationsTable string
	json            bool
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// flags returns the command's flag set with the common flags registered.
func (e *env) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+e.cmd.name, flag.ContinueOnError)
	// The flag package prints its error and the whole usage on a parse
	// error; idem prints one line instead (RunContext), and the usage only
	// for -h (parse).
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&e.databaseURL, "database-url", envOr("DATABASE_URL", defaultDatabaseURL), "database URL or DSN ($DATABASE_URL)")
	fs.StringVar(&e.dialectName, "dialect", envOr("IDEM_DIALECT", "postgres"), "SQL dialect: postgres, mysql or sqlite ($IDEM_DIALECT)")
	fs.StringVar(&e.amqpURL, "amqp-url", envOr("AMQP_URL", defaultAMQPURL), "RabbitMQ URL ($AMQP_URL)")
	fs.StringVar(&e.processedTable, "processed-table", processedstore.DefaultTable, "processed-event table, name or schema.name")
	fs.StringVar(&e.operationsTable, "operations-table", operation.DefaultTable, "operations table, name or schema.name")
	fs.BoolVar(&e.json, "json", false, "print one JSON document instead of a table")
	return fs
}

// parse parses args with flags and positional arguments in any order and
// returns the positional ones; it checks their number is in [minPos, maxPos].
func (e *env) parse(fs *flag.FlagSet, args []string, minPos, maxPos int) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fmt.Fprintf(e.stderr, "usage: idem %s\n\nFlags:\n", e.cmd.usage)
				fs.SetOutput(e.stderr)
				fs.PrintDefaults()
				fmt.Fprint(e.stderr, "\n"+exitCodesHelp)
				return nil, err
			}
			return nil, usageErr("%v", err)
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if len(pos) < minPos || len(pos) > maxPos {
		return nil, usageErr("usage: idem %s", e.cmd.usage)
	}
	return pos, nil
}

func (e *env) dialect() (sqldb.Dialect, error) {
	switch strings.ToLower(e.dialectName) {
	case "postgres", "postgresql", "pg":
		return sqldb.PostgreSQL, nil
	case "mysql", "mariadb":
		return sqldb.MySQL, nil
	case "sqlite", "sqlite3":
		return sqldb.SQLite, nil
	}
	return 0, usageErr("--dialect %q: want postgres, mysql or sqlite", e.dialectName)
}

// openDB opens and pings the database through database/sql (pgx's stdlib
// for PostgreSQL), so every dialect shares one code path.
func (e *env) openDB(ctx context.Context) (*sql.DB, sqldb.Dialect, error) {
	d, err := e.dialect()
	if err != nil {
		return nil, 0, err
	}
	driver, dsn := "pgx", e.databaseURL
	switch d {
	case sqldb.MySQL:
		driver = "mysql"
		// The library's DATETIME columns hold UTC: read them as UTC
		// whatever the DSN says (a service's loc=Local shifted every time
		// shown by the zone's offset).
		cfg, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, 0, usageErr("--database-url: %v", err)
		}
		cfg.ParseTime, cfg.Loc = true, time.UTC
		dsn = cfg.FormatDSN()
	case sqldb.SQLite:
		driver = "sqlite"
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return nil, 0, usageErr("--database-url: %v", err)
	}
	db.SetMaxOpenConns(4)
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		return nil, 0, failedErr("database %s unreachable: %v", redact(e.databaseURL), err)
	}
	return db, d, nil
}

// dbErr turns a database error into a one-line failure, naming a missing
// table (SQLSTATE 42P01, MySQL ER_NO_SUCH_TABLE 1146) as such; SQLite
// reports it as a generic SQLITE_ERROR, shown as is.
func dbErr(what, table string, err error) error {
	var pg *pgconn.PgError
	var my *mysql.MySQLError
	if (errors.As(err, &pg) && pg.Code == "42P01") || (errors.As(err, &my) && my.Number == 1146) {
		return failedErr("%s: table %s does not exist (wrong table flag, or search_path?)", what, table)
	}
	return failedErr("%s: %v", what, err)
}

// redact hides a password in a database or broker address: a URL's
// user:password@, a go-sql-driver/mysql DSN's user:password@ (before the
// address's /dbname), and a password= keyword or query parameter.
func redact(u string) string {
	u = passwordParam.ReplaceAllString(u, "${1}***")
	scheme := strings.Index(u, "://")
	start, end := 0, len(u)
	if scheme >= 0 {
		start = scheme + 3
		if i := strings.IndexAny(u[start:], "/?"); i >= 0 {
			end = start + i
		}
	} else if i := strings.LastIndex(u, "/"); i >= 0 { // user:password@tcp(host)/db
		end = i
	}
	at := strings.LastIndex(u[start:end], "@")
	if at < 0 || (scheme < 0 && !mysqlAddress.MatchString(u[start+at+1:end])) {
		return u
	}
	at += start
	if i := strings.Index(u[start:at], ":"); i >= 0 {
		return u[:start+i] + ":***" + u[at:]
	}
	return u
}

// mysqlAddress matches what follows the credentials of a
// go-sql-driver/mysql DSN, before /dbname: nothing or protocol(address).
var mysqlAddress = regexp.MustCompile(`^(\w+\(.*\))?$`)

// passwordParam matches a password given as a keyword (PostgreSQL's
// "password=…", quoted or not) or a query parameter.
var passwordParam = regexp.MustCompile(`(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)`)
