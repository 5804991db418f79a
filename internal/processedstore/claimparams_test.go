package processedstore_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// ClaimParamsAt is ClaimQueryAt / ClaimIdentityQueryAt unboxed: the same
// arguments in the same order (on the plain layout with the lean
// statement), on every layout
// (the partitioned layout routes ids that are not UUIDv7 to the side
// table), with and without the replay window, identity and event time.
func TestClaimParamsMatchClaimQuery(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 678901234, time.UTC)
	for _, cfg := range []processedstore.Config{
		{},
		{Horizon: time.Hour},
		{Layout: processedstore.LayoutPartitioned, Horizon: 2 * time.Hour},
	} {
		s, err := processedstore.NewStore(cfg)
		require.NoError(t, err)
		for _, id := range []uuid.UUID{uuid.Must(uuid.NewV7()), uuid.New()} {
			for _, when := range []time.Time{{}, at} {
				ident := processedstore.NewIdentity("order.placed", []byte(`{"n":1}`))
				for _, withID := range []bool{false, true} {
					var q string
					var args []any
					var ip *processedstore.Identity
					if withID {
						q, args = s.ClaimIdentityQueryAt("stock", id, when, ident)
						ip = &ident
					} else {
						q, args = s.ClaimQueryAt("stock", id, when)
					}
					p, ok := s.ClaimParamsAt("stock", id, when, ip)
					require.True(t, ok)
					if cfg.Layout == processedstore.LayoutPartitioned {
						require.Equal(t, q, p.SQL)
					} else {
						// The lean claim (pgx beginner only):
						// same parameters, no event_at for a
						// UUIDv7.
						require.Equal(t, id.Version() == 7, !strings.Contains(p.SQL, "event_at"), p.SQL)
					}
					want := []any{"stock", pgtype.UUID{Bytes: id, Valid: true}, nil}
					if p.HasEventAt {
						want[2] = p.EventAt
					}
					if withID {
						want = append(want, p.EventName, p.Fingerprint[:p.FingerprintLen])
						require.True(t, p.Identity)
					}
					require.Equal(t, want, args, "cfg %+v id v%d at %v identity %v", cfg, id.Version(), when, withID)
				}
			}
		}
	}
	mysql, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL})
	require.NoError(t, err)
	_, ok := mysql.ClaimParamsAt("stock", uuid.New(), time.Time{}, nil)
	require.False(t, ok)
}
