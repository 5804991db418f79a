package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"time"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/operation"
)

// resolveWait bounds how long resolve waits for a live worker that holds
// the key before it refuses.
const resolveWait = 2 * time.Second

// operationRow is one record in the JSON output (the result bytes are
// never printed).
type operationRow struct {
	Key         string   `json:"key"`
	Kind        string   `json:"kind"`
	State       string   `json:"state"`
	Fingerprint string   `json:"fingerprint"`
	Reference   string   `json:"reference,omitempty"`
	Error       string   `json:"error,omitempty"`
	Attempts    int      `json:"attempts"`
	Owned       bool     `json:"owned"` // an attempt owns it (started: in flight, or died in flight)
	CreatedAt   jsonTime `json:"created_at"`
	UpdatedAt   jsonTime `json:"updated_at"`
}

func toRow(r operation.Record) operationRow {
	return operationRow{Key: r.Key, Kind: r.Kind, State: string(r.State), Fingerprint: r.Fingerprint, Reference: r.Reference,
		Error: r.Error, Attempts: r.Attempts, Owned: r.Owner != "", CreatedAt: jsonTime(r.CreatedAt), UpdatedAt: jsonTime(r.UpdatedAt)}
}

func (e *env) runner(ctx context.Context) (*operation.Runner, *sql.DB, error) {
	db, d, err := e.openDB(ctx)
	if err != nil {
		return nil, nil, err
	}
	r, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, d), Table: e.operationsTable, Wait: resolveWait}, nil)
	if err != nil {
		_ = db.Close()
		return nil, nil, usageErr("%v", err)
	}
	return r, db, nil
}

func parseState(s string) (operation.State, error) {
	switch operation.State(s) {
	case operation.StateStarted, operation.StateSucceeded, operation.StateFailed, operation.StateUncertain:
		return operation.State(s), nil
	case "all":
		return "", nil
	}
	return "", usageErr("--state %q: want uncertain, started, succeeded, failed or all", s)
}

func runOperationsList(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	stateFlag := fs.String("state", string(operation.StateUncertain), "uncertain, started, succeeded, failed or all")
	limit := fs.Int("limit", operation.DefaultListLimit, "at most N records, least recently updated first")
	if _, err := e.parse(fs, args, 0, 0); err != nil {
		return err
	}
	state, err := parseState(*stateFlag)
	if err != nil {
		return err
	}
	if *limit <= 0 {
		return usageErr("--limit %d: must be > 0", *limit)
	}
	r, db, err := e.runner(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	recs, err := r.List(ctx, state, *limit)
	if err != nil {
		return dbErr("operations list", e.operationsTable, err)
	}
	rows := make([]operationRow, 0, len(recs))
	for _, rec := range recs {
		rows = append(rows, toRow(rec))
	}
	if e.json {
		return printJSON(e.stdout, map[string]any{"state": *stateFlag, "operations": rows})
	}
	fmt.Fprintf(e.stdout, "%d operation(s) in state %s\n\n", len(rows), *stateFlag)
	var tr [][]string
	for _, o := range rows {
		tr = append(tr, []string{o.Key, o.State, strconv.Itoa(o.Attempts), dash(o.Reference), truncate(o.Fingerprint, 13),
			ts(time.Time(o.UpdatedAt)), truncate(dash(o.Error), 50)})
	}
	table(e.stdout, []string{"KEY", "STATE", "ATTEMPTS", "REFERENCE", "FINGERPRINT", "UPDATED_AT", "ERROR"}, tr)
	return nil
}

func runOperationsResolve(ctx context.Context, e *env, args []string) error {
	fs := e.flags()
	succeeded := fs.String("succeeded", "", "the provider did it: its reference (charge id, message id)")
	failed := fs.String("failed", "", "the provider refused it: the reason")
	notExecuted := fs.String("not-executed", "", "the provider has no trace of it: the reason (the next attempt calls again, same key)")
	by := fs.String("by", defaultBy(), "who decides (default $USER, else the OS user name)")
	fingerprint := fs.String("fingerprint", "", "refuse unless the record's parameter fingerprint is this one (as listed)")
	note := fs.String("note", "", "free text recorded with the verdict")
	pos, err := e.parse(fs, args, 1, 1)
	if err != nil {
		return err
	}
	n := 0
	for _, s := range []string{*succeeded, *failed, *notExecuted} {
		if s != "" {
			n++
		}
	}
	if n != 1 {
		return usageErr("give one of --succeeded REF, --failed REASON, --not-executed REASON")
	}
	if *by == "" {
		return usageErr("--by: who resolves it (no $USER)")
	}
	key, err := operation.ParseKey(pos[0])
	if err != nil {
		return usageErr("%v", err)
	}
	r, db, err := e.runner(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	rec, err := r.Get(ctx, key)
	switch {
	case errors.Is(err, operation.ErrNoRecord):
		return notFoundErr("no operation with key %s", key)
	case err != nil:
		return dbErr("operations resolve", e.operationsTable, err)
	}
	if *fingerprint != "" && !fingerprintMatches(rec.Fingerprint, *fingerprint) {
		return refusedErr("operation %s: fingerprint %s is not the recorded %s (nothing changed)", key, *fingerprint, rec.Fingerprint)
	}
	switch {
	case rec.State == operation.StateSucceeded || rec.State == operation.StateFailed:
		return refusedErr("operation %s is already %s (final; nothing changed)", key, rec.State)
	case rec.State == operation.StateStarted && rec.Owner == "":
		return refusedErr("operation %s is started with no call in flight, not uncertain: the next attempt calls the provider (nothing changed)", key)
	}

	var v operation.Verdict
	var text string
	switch {
	case *succeeded != "":
		v, text = operation.VerdictSucceeded(operation.Result{Reference: *succeeded}), "succeeded (reference "+*succeeded+")"
	case *failed != "":
		v, text = operation.VerdictFailed(*failed), "failed: "+*failed
	default:
		v, text = operation.VerdictNotExecuted(*notExecuted), "not executed: "+*notExecuted
	}
	noteText := "resolved " + text + " by " + *by + " with idem"
	if *note != "" {
		noteText += ": " + *note
	}
	if rec.Error != "" {
		noteText += " (was " + string(rec.State) + ": " + rec.Error + ")"
	}
	if err := r.Resolve(ctx, key, v.WithNote(noteText)); err != nil {
		switch {
		case errors.Is(err, operation.ErrFinal):
			return refusedErr("operation %s became final meanwhile (nothing changed)", key)
		case errors.Is(err, operation.ErrInProgress):
			return refusedErr("operation %s is in progress in a live worker (nothing changed): %v", key, err)
		case errors.Is(err, operation.ErrNoRecord):
			return notFoundErr("no operation with key %s", key)
		}
		return dbErr("operations resolve", e.operationsTable, err)
	}
	after, err := r.Get(ctx, key)
	if err != nil {
		return dbErr("operations resolve: read back", e.operationsTable, err)
	}
	row := toRow(after)
	if e.json {
		return printJSON(e.stdout, map[string]any{"resolved": true, "by": *by, "from": string(rec.State), "operation": row})
	}
	fields(e.stdout, [][2]string{
		{"key", row.Key}, {"from", string(rec.State)}, {"to", row.State}, {"reference", dash(row.Reference)},
		{"by", *by}, {"at", ts(time.Time(row.UpdatedAt)) + " (database clock)"}, {"recorded", row.Error},
	})
	return nil
}

// defaultBy is $USER, else $LOGNAME, else the OS account's name.
func defaultBy() string {
	for _, v := range []string{"USER", "LOGNAME"} {
		if s := os.Getenv(v); s != "" {
			return s
		}
	}
	if u, err := user.Current(); err == nil {
		return u.Username
	}
	return ""
}

// fingerprintMatches accepts the full fingerprint or a prefix of at least
// 12 characters (the listed, abbreviated form).
func fingerprintMatches(stored, given string) bool {
	if len(given) >= 12 && len(given) <= len(stored) && stored[:len(given)] == given {
		return true
	}
	return stored == given
}
