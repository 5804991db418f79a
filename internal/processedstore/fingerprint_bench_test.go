package processedstore_test

import (
	"strings"
	"testing"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// BenchmarkNewIdentity is the client-side cost of payload verification per
// message: the SHA-256 of the event name and a 200-byte payload.
//
//	go test -run '^$' -bench NewIdentity ./processed/
func BenchmarkNewIdentity(b *testing.B) {
	payload := []byte(`{"order_id":42,"lines":[` + strings.Repeat(`{"sku":"A-1","qty":1},`, 8) + `{"sku":"B","qty":2}]}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(payload)))
	for i := 0; i < b.N; i++ {
		_ = processedstore.NewIdentity("order.placed", payload)
	}
}
