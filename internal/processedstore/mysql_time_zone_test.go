package processedstore_test

import (
	"context"
	"database/sql"
	"net/url"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
)

// On MySQL/MariaDB the claim's window and the purge's cutoff are the
// server's UTC clock (UTC_TIMESTAMP), whatever the session's time_zone:
// with the session 13 hours ahead of UTC or 12 behind, an event inside
// the horizon is claimed and its row kept, one outside it is refused and
// its row purged, one ahead within the skew is claimed, and one beyond it
// is refused as future.
func TestMySQLWindowAndPurgeAnySessionTimeZone(t *testing.T) {
	t.Parallel()
	for _, zone := range []string{"+13:00", "-12:00"} {
		t.Run(zone, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			name := testenv.MySQLDatabase(t)
			testenv.RequireDriver(t, "mysql")
			db, err := sql.Open("mysql", testenv.MySQLDatabaseDSN(name)+"&time_zone="+url.QueryEscape("'"+zone+"'"))
			require.NoError(t, err)
			t.Cleanup(func() { _ = db.Close() })
			var session string
			require.NoError(t, db.QueryRow(`SELECT @@session.time_zone`).Scan(&session))
			require.Equal(t, zone, session)

			s, err := processedstore.NewStore(processedstore.Config{Dialect: sqldb.MySQL, Horizon: time.Hour, MaxFutureSkew: 10 * time.Minute})
			require.NoError(t, err)
			require.NoError(t, s.Migrate(ctx, sqldb.Std(db)))
			claim := func(id uuid.UUID) (bool, error) {
				tx, err := db.BeginTx(ctx, nil)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback() }()
				ok, err := s.Claim(ctx, sqldb.Std(tx), "c", id)
				if err == nil {
					require.NoError(t, tx.Commit())
				}
				return ok, err
			}
			now := time.Now()
			for _, c := range []struct {
				at   time.Time
				want error
			}{
				{now.Add(-61 * time.Minute), processedstore.ErrExpired},
				{now.Add(-50 * time.Minute), nil},
				{now.Add(9 * time.Minute), nil},
				{now.Add(11 * time.Minute), processedstore.ErrFuture},
			} {
				ok, err := claim(v7At(c.at))
				require.ErrorIs(t, err, c.want, "event dated %s", c.at.Sub(now))
				require.Equal(t, c.want == nil, ok, "event dated %s", c.at.Sub(now))
			}

			inside, outside := uuid.New(), uuid.New()
			_, err = db.ExecContext(ctx, `INSERT INTO processed_event (consumer, event_id, event_at) VALUES
				('c', ?, UTC_TIMESTAMP(6) - INTERVAL 59 MINUTE), ('c', ?, UTC_TIMESTAMP(6) - INTERVAL 66 MINUTE)`, inside[:], outside[:])
			require.NoError(t, err) // horizon 1 h, kept 5 min more (purgeClaimSlack)
			p, err := processedstore.NewPurger(s, sqldb.StdPool(db), processedstore.PurgerConfig{Horizon: time.Hour}, nil)
			require.NoError(t, err)
			n, ran, err := p.PurgeNow(ctx)
			require.NoError(t, err)
			require.True(t, ran)
			require.EqualValues(t, 1, n, "only the row outside the horizon goes")
			ok, err := s.Processed(ctx, sqldb.Std(db), "c", inside)
			require.NoError(t, err)
			require.True(t, ok, "a row inside the horizon stays")
			ok, err = s.Processed(ctx, sqldb.Std(db), "c", outside)
			require.NoError(t, err)
			require.False(t, ok, "a row outside the horizon goes")
		})
	}
}
