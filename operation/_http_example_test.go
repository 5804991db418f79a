package operation_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	_ "modernc.org/sqlite" // database/sql driver "sqlite"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/operation"
)

// An operation key around an HTTP call: a payment provider (an httptest
// server) is charged once for order o-42, although the handler runs twice
// (a redelivery). The second Do returns the stored result without calling
// the provider; the key also travels as the provider's Idempotency-Key.
// The operations table lives in an SQLite file here; PostgreSQL and MySQL
// work the same way (Config.Pool or Config.DB with their Dialect).
func ExampleRunner_Do_http() {
	var charges atomic.Int32
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"ch_%d","idempotency_key":%q}`, n, r.Header.Get("Idempotency-Key"))
	}))
	defer provider.Close()

	dir, _ := os.MkdirTemp("", "operation-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "ops.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()
	runner, err := operation.NewRunner(operation.Config{DB: idempotency.SQL(db, idempotency.SQLite)}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	if err := runner.Migrate(ctx); err != nil {
		panic(err)
	}

	charge := func(ctx context.Context, key string) (operation.Result, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/charges", strings.NewReader(`{"amount":4200}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := provider.Client().Do(req)
		if err != nil {
			return operation.Result{}, operation.Timeout(err) // the provider may have charged: uncertain
		}
		defer resp.Body.Close()
		var body struct {
			ID string `json:"id"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			return operation.Result{}, operation.Timeout(err)
		}
		return operation.Result{Reference: body.ID}, nil
	}

	key := operation.MustKey("charge", "o-42")
	params := map[string]any{"amount": 4200, "currency": "EUR"}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := runner.Do(ctx, key, params, charge)
		if err != nil {
			panic(err)
		}
		fmt.Printf("delivery %d: %s %s\n", delivery, res.Reference, res.Origin)
	}
	fmt.Println("provider charges:", charges.Load())
	// Output:
	// delivery 1: ch_1 call
	// delivery 2: ch_1 stored
	// provider charges: 1
}
