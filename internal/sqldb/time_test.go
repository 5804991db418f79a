package sqldb_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

func TestTimeScansEveryDialectsForm(t *testing.T) {
	t.Parallel()
	want := time.Date(2024, 7, 1, 10, 0, 0, 123000000, time.UTC)
	for _, src := range []any{want, "2024-07-01T10:00:00.123Z", []byte("2024-07-01 10:00:00.123"), "2024-07-01T10:00:00.123"} {
		var ts sqldb.Time
		require.NoError(t, ts.Scan(src), "%v", src)
		require.True(t, ts.T.Equal(want), "%v → %v", src, ts.T)
	}
	var ts sqldb.Time
	require.NoError(t, ts.Scan(nil))
	require.True(t, ts.T.IsZero())
	require.Error(t, ts.Scan(42))
	require.Error(t, ts.Scan("yesterday"))
}
