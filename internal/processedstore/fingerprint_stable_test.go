package processedstore_test

import (
	"crypto/sha256"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// The fingerprint a claim stores is version 2: 0x02 ‖ the first 8 bytes
// of SHA-256(uvarint(len(name)) ‖ name ‖ payload), whatever the sizes (the
// stack buffer of NewIdentity and its heap fallback give the same); a row
// of version 1 (0x01 ‖ the whole SHA-256, written by earlier releases) is
// compared with the same bytes' whole hash.
func TestFingerprintAlgorithmIsStable(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, payload string }{
		{"order.placed", `{"n":1}`},
		{strings.Repeat("n", 200), strings.Repeat("p", 100)}, // uvarint of 200 takes two bytes
		{"big", strings.Repeat("x", 5000)},                   // beyond the stack buffer
	} {
		var want []byte
		n := len(c.name)
		for n >= 0x80 {
			want = append(want, byte(n)|0x80)
			n >>= 7
		}
		want = append(want, byte(n))
		sum := sha256.Sum256(append(append(want, c.name...), c.payload...))
		got := processedstore.NewIdentity(c.name, []byte(c.payload))
		require.Equal(t, append([]byte{2}, sum[:8]...), got.FingerprintBytes(), "name %d bytes, payload %d bytes", len(c.name), len(c.payload))
		v1 := processedstore.StoredIdentity{Found: true, Fingerprint: append([]byte{1}, sum[:]...)}
		require.Equal(t, processedstore.SameEvent, got.Verdict(v1), "a version-1 row of the same event")
		other := processedstore.NewIdentity(c.name, []byte(c.payload+" "))
		require.Equal(t, processedstore.OtherEvent, other.Verdict(v1), "a version-1 row of another payload")
	}
}
