package processedstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/uuid"
	_ "modernc.org/sqlite" // database/sql driver "sqlite"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Claiming an event inside the transaction of its effect: the first claim
// inserts the row, a redelivery's claim finds it (the middleware then skips
// the handler). Rolled back, a claim leaves nothing, so the event is
// processed again later. Here on SQLite; the same on PostgreSQL (sqldb.Pgx)
// and MySQL.
func ExampleStore_Claim() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "processed-example")
	defer os.RemoveAll(dir)
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "stock.db")+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		panic(err)
	}
	defer db.Close()
	store, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.SQLite})
	if err != nil {
		panic(err)
	}
	if err := store.Migrate(ctx, sqldb.Std(db)); err != nil {
		panic(err)
	}

	id := uuid.MustParse("01906dbc-ad00-70a1-8a1b-2c3d4e5f6a7b")
	claim := func(commit bool) bool {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			panic(err)
		}
		defer tx.Rollback()
		first, err := store.Claim(ctx, sqldb.Std(tx), "stock", id)
		if err != nil {
			panic(err)
		}
		// … the effect, in tx …
		if commit {
			if err := tx.Commit(); err != nil {
				panic(err)
			}
		}
		return first
	}
	fmt.Println("rolled back, first:", claim(false))
	fmt.Println("committed, first:", claim(true))
	fmt.Println("redelivery, first:", claim(true))
	done, _ := store.Processed(ctx, sqldb.Std(db), "stock", id)
	fmt.Println("processed:", done)
	// Output:
	// rolled back, first: true
	// committed, first: true
	// redelivery, first: false
	// processed: true
}
