package processedstore_test

import (
	"crypto/sha256"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// The fingerprint a claim stores is version 3: 0x03 ‖ XXH64 (seed 0,
// big-endian) of uvarint(len(name)) ‖ name ‖ payload, whatever the sizes;
// rows of version 2 (0x02 ‖ the first 8 bytes of SHA-256 of the same
// bytes) and version 1 (0x01 ‖ the whole SHA-256), written by earlier
// releases, are compared with the same bytes' SHA-256 (the stack buffer
// and its heap fallback give the same), and found the same event or
// another one.
func TestFingerprintAlgorithmIsStable(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, payload string }{
		{"order.placed", `{"n":1}`},
		{strings.Repeat("n", 200), strings.Repeat("p", 100)}, // uvarint of 200 takes two bytes
		{"big", strings.Repeat("x", 5000)},                   // beyond SHA-256's stack buffer
	} {
		var want []byte
		n := len(c.name)
		for n >= 0x80 {
			want = append(want, byte(n)|0x80)
			n >>= 7
		}
		want = append(want, byte(n))
		whole := append(append(want, c.name...), c.payload...)
		sum := sha256.Sum256(whole)
		got := processedstore.NewIdentity(c.name, []byte(c.payload))
		require.Equal(t, binary.BigEndian.AppendUint64([]byte{3}, xxhash.Sum64(whole)), got.FingerprintBytes(),
			"name %d bytes, payload %d bytes", len(c.name), len(c.payload))
		other := processedstore.NewIdentity(c.name, []byte(c.payload+" "))
		for _, stored := range [][]byte{append([]byte{1}, sum[:]...), append([]byte{2}, sum[:8]...)} {
			row := processedstore.StoredIdentity{Found: true, Fingerprint: stored}
			require.Equal(t, processedstore.SameEvent, got.Verdict(row), "a version-%d row of the same event", stored[0])
			require.Equal(t, processedstore.OtherEvent, other.Verdict(row), "a version-%d row of another payload", stored[0])
		}
	}
}
