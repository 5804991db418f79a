package middleware_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
	"github.com/watermill-idempotency/idempotency/sqldb"
)

// BenchmarkPayloadVerification measures the claim with and without payload
// verification (Config.DisablePayloadVerification) on the pgx pipelined
// beginner, with an empty handler and a 200-byte payload: "new" claims a new
// event per iteration (BEGIN + claim + COMMIT), "duplicate" one event that
// is already processed (BEGIN + claim + ROLLBACK, plus the fingerprint read
// when verification is on).
//
//	go test -run '^$' -bench PayloadVerification -benchtime 3000x -count 6 ./middleware/
func BenchmarkPayloadVerification(b *testing.B) {
	payload := `{"order_id":42,"lines":[` + strings.Repeat(`{"sku":"A-1","qty":1},`, 8) + `{"sku":"B","qty":2}]}`
	for _, path := range []string{"new", "duplicate"} {
		for _, verify := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/verify=%v", path, verify), func(b *testing.B) {
				pool, _ := testenv.Pool(b)
				store, err := processed.NewStore(processed.Config{})
				if err != nil {
					b.Fatal(err)
				}
				if err := store.Migrate(context.Background(), sqldb.Pgx(pool)); err != nil {
					b.Fatal(err)
				}
				m, err := middleware.NewIdempotent(middleware.Config{
					Beginner: middleware.NewPgxBeginner(pool, middleware.PgxBeginnerConfig{}),
					Store:    store, Consumer: "stock", DisablePayloadVerification: !verify,
				}, nil)
				if err != nil {
					b.Fatal(err)
				}
				h := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
				dup := uuid.Must(uuid.NewV7()).String()
				if _, err := h(evMsg(dup, "order.placed", payload)); err != nil {
					b.Fatal(err)
				}
				ids := make([]string, b.N)
				for i := range ids {
					ids[i] = uuid.Must(uuid.NewV7()).String()
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					id := dup
					if path == "new" {
						id = ids[i]
					}
					if _, err := h(evMsg(id, "order.placed", payload)); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
