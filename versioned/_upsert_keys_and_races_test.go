package versioned_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// Three distinct customers whose ids differ only by case or a trailing
// space, each with its first event: three rows inserted on every driver,
// with the key column the package doc asks for on MySQL (VARBINARY). With
// MariaDB's default collation (case-insensitive, PAD SPACE) the second and
// third customers' events were reported Stale (nil error: acked) and their
// state never written.
func TestUpsertKeysDifferingOnlyInCaseOrPaddingAreDistinct(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			h := d.open(t, 4)
			table := testenv.UniqueName("ucust")
			h.exec(t, h.customerDDL(table))
			u := customerUpsert(t, h, table)
			events := []struct {
				id      string
				version int64
				name    string
			}{{"Cust-1", 7, "Alice"}, {"cust-1", 1, "Bob"}, {"Cust-1 ", 2, "Carol"}}
			for _, ev := range events {
				out, err := h.apply(t, u, []any{ev.id}, v(ev.version), []any{ev.name})
				require.NoError(t, err)
				require.Equal(t, versioned.Inserted, out, "first event of customer %q", ev.id)
			}
		})
	}
}

// Out-of-order and duplicated versions of one key from 8 concurrent
// writers, each Apply in its own transaction, retried on error (1213
// deadlocks, SQLITE_BUSY): the stored row is the highest version with its
// own value.
func TestUpsertConcurrentOutOfOrderVersionsKeepTheHighest(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		if d.name != testenv.TargetMariaDB && d.name != testenv.TargetSQLite {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			h := d.open(t, 8)
			table := testenv.UniqueName("urace")
			h.exec(t, h.customerDDL(table))
			u := customerUpsert(t, h, table)
			var versions []int64
			for i := int64(1); i <= 60; i++ {
				versions = append(versions, i, i) // duplicated
			}
			rand.Shuffle(len(versions), func(i, j int) { versions[i], versions[j] = versions[j], versions[i] })
			work := make(chan int64, len(versions))
			for _, x := range versions {
				work <- x
			}
			close(work)
			var wg sync.WaitGroup
			var mu sync.Mutex
			retries := 0
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for x := range work {
						for try := 0; ; try++ {
							tx, err := h.BeginTx(context.Background())
							if err == nil {
								_, err = u.Apply(context.Background(), testenv.AsTx(tx), []any{"c"}, v(x), []any{fmt.Sprintf("n%d", x)})
								if err == nil {
									err = tx.Commit()
								} else {
									_ = tx.Rollback()
								}
							}
							if err == nil {
								break
							}
							mu.Lock()
							retries++
							mu.Unlock()
							if try > 50 {
								t.Errorf("version %d: %v", x, err)
								break
							}
						}
					}
				}()
			}
			wg.Wait()
			t.Logf("retries: %d", retries)
			requireCustomer(t, h, table, "c", 60, "n60")
		})
	}
}
