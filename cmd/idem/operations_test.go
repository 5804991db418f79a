package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/operation"
)

type charge struct {
	Order  string `json:"order"`
	Amount int    `json:"amount"`
}

func TestOperationsListAndResolve(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _, schema := schemaDB(t)
	r, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.PostgreSQL)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	do := func(entity string, callErr error) operation.Key {
		k := operation.MustKey("charge", entity)
		_, _ = r.Do(ctx, k, charge{entity, 100}, func(context.Context, string) (operation.Result, error) {
			if callErr != nil {
				return operation.Result{}, callErr
			}
			return operation.Result{Reference: "ch_" + entity}, nil
		})
		return k
	}
	u1 := do("order-1", operation.Timeout(errors.New("provider timeout after 30s")))
	u2 := do("order-2", operation.Timeout(errors.New("provider timeout after 30s")))
	u3 := do("order-3", operation.Timeout(errors.New("provider timeout after 30s")))
	released := do("order-4", operation.Transient(errors.New("503")))
	done := do("order-5", nil)

	// list: the uncertain ones, with their fingerprint.
	res := idem(t, schema, "operations", "list", "--state", "uncertain", "--json")
	wantCode(t, res, exitOK)
	list := decode[struct{ Operations []operationRow }](t, res)
	if len(list.Operations) != 3 || list.Operations[0].Key != u1.String() || list.Operations[0].State != "uncertain" ||
		!strings.Contains(list.Operations[0].Error, "timeout") || len(list.Operations[0].Fingerprint) != 64 {
		t.Fatalf("list: %+v", list)
	}
	fp1 := list.Operations[0].Fingerprint
	res = idem(t, schema, "operations", "list")
	wantCode(t, res, exitOK)
	if !strings.Contains(res.stdout, u2.String()) || strings.Contains(res.stdout, done.String()) {
		t.Fatalf("table: %s", res.stdout)
	}
	wantCode(t, idem(t, schema, "operations", "list", "--state", "weird"), exitUsage)

	// resolve --succeeded, with the listed fingerprint: recorded, with who;
	// the next Do returns the stored result without calling.
	res = idem(t, schema, "operations", "resolve", u1.String(), "--succeeded", "ch_991", "--by", "alice", "--fingerprint", fp1[:12], "--json")
	wantCode(t, res, exitOK)
	rec, err := r.Get(ctx, u1)
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != operation.StateSucceeded || rec.Reference != "ch_991" || !strings.Contains(rec.Error, "by alice") || !strings.Contains(rec.Error, "timeout") {
		t.Fatalf("record: %+v", rec)
	}
	got, err := r.Do(ctx, u1, charge{"order-1", 100}, func(context.Context, string) (operation.Result, error) {
		t.Fatal("called the provider after a resolve")
		return operation.Result{}, nil
	})
	if err != nil || got.Origin != operation.OriginStored || got.Reference != "ch_991" {
		t.Fatalf("Do after resolve: %+v %v", got, err)
	}

	// resolve --failed: later Do returns the rejection.
	wantCode(t, idem(t, schema, "operations", "resolve", u2.String(), "--failed", "card declined", "--by", "bob"), exitOK)
	if _, err := r.Do(ctx, u2, charge{"order-2", 100}, func(context.Context, string) (operation.Result, error) {
		t.Fatal("called")
		return operation.Result{}, nil
	}); !errors.Is(err, operation.ErrFailed) {
		t.Fatalf("Do after --failed: %v", err)
	}

	// Refusals: one line, exit 3, nothing changed.
	before, _ := r.Get(ctx, u3)
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{u1.String(), "--succeeded", "ch_2"}, exitRefused},                                      // final
		{[]string{u3.String(), "--succeeded", "ch_2", "--fingerprint", "0123456789abcdef"}, exitRefused}, // wrong fingerprint
		{[]string{released.String(), "--succeeded", "ch_2"}, exitRefused},                                // not uncertain
		{[]string{done.String(), "--failed", "x"}, exitRefused},                                          // final
		{[]string{"charge:nope", "--succeeded", "ch_2"}, exitNotFound},
		{[]string{"not a key", "--succeeded", "ch_2"}, exitUsage},
		{[]string{u3.String()}, exitUsage},
		{[]string{u3.String(), "--succeeded", "a", "--failed", "b"}, exitUsage},
	} {
		res := idem(t, schema, append([]string{"operations", "resolve"}, c.args...)...)
		wantCode(t, res, c.code)
		if n := strings.Count(strings.TrimSpace(res.stderr), "\n"); n != 0 || res.stderr == "" {
			t.Fatalf("%v: want a one-line error, got %q", c.args, res.stderr)
		}
	}
	after, _ := r.Get(ctx, u3)
	if after.State != before.State || !after.UpdatedAt.Equal(before.UpdatedAt) {
		t.Fatalf("a refused resolve changed the record: %+v → %+v", before, after)
	}
}
