package inbox_test

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// BenchmarkPayloadVerification measures the claim with and without payload
// verification (Config.DisablePayloadVerification) on the pgx pipelined
// beginner, an empty handler and a 200-byte payload. The two variants
// alternate message by message on one table (so a machine under changing
// load slows both alike), on sessions with synchronous_commit off (the WAL
// flush of each commit would otherwise dominate and hide the difference).
// Reported: the median wall time per message of each variant, for a new
// event (BEGIN + claim + COMMIT) and for a duplicate (BEGIN + claim +
// ROLLBACK, plus the fingerprint read when verification is on), and the
// ratio verified/plain.
//
//	go test -run '^$' -bench PayloadVerification -benchtime 2000x ./middleware/
func BenchmarkPayloadVerification(b *testing.B) {
	payload := `{"order_id":42,"lines":[` + strings.Repeat(`{"sku":"A-1","qty":1},`, 8) + `{"sku":"B","qty":2}]}`
	_, schema := testenv.Pool(b)
	cfg := testenv.PoolConfig(b, testenv.SchemaURL(schema), schema, 4)
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	store, err := processedstore.NewStore(processedstore.Config{})
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Migrate(context.Background(), sqldb.Pgx(pool)); err != nil {
		b.Fatal(err)
	}
	handler := func(verify bool) message.HandlerFunc {
		m, err := inbox.NewIdempotent(inbox.Config{
			Beginner: mustBeginner(inbox.NewPgxBeginner(pool, inbox.PgxBeginnerConfig{})),
			Store:    store, Consumer: "stock", DisablePayloadVerification: !verify,
		}, nil)
		if err != nil {
			b.Fatal(err)
		}
		return m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	}
	plain, verified := handler(false), handler(true)
	dupPlain, dupVerified := uuid.Must(uuid.NewV7()).String(), uuid.Must(uuid.NewV7()).String()
	for _, c := range []struct {
		h  message.HandlerFunc
		id string
	}{{plain, dupPlain}, {verified, dupVerified}} {
		if _, err := c.h(evMsg(c.id, "order.placed", payload)); err != nil {
			b.Fatal(err)
		}
	}
	run := func(h message.HandlerFunc, id string) time.Duration {
		start := time.Now()
		if _, err := h(evMsg(id, "order.placed", payload)); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	var newP, newV, dupP, dupV []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		newP = append(newP, run(plain, uuid.Must(uuid.NewV7()).String()))
		newV = append(newV, run(verified, uuid.Must(uuid.NewV7()).String()))
		dupP = append(dupP, run(plain, dupPlain))
		dupV = append(dupV, run(verified, dupVerified))
	}
	b.StopTimer()
	med := func(d []time.Duration) float64 {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return float64(d[len(d)/2].Nanoseconds())
	}
	np, nv, dp, dv := med(newP), med(newV), med(dupP), med(dupV)
	b.ReportMetric(np, "new-plain-ns")
	b.ReportMetric(nv, "new-verified-ns")
	b.ReportMetric(nv/np, "new-ratio")
	b.ReportMetric(dp, "dup-plain-ns")
	b.ReportMetric(dv, "dup-verified-ns")
	b.ReportMetric(dv/dp, "dup-ratio")
}
