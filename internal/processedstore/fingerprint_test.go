package processedstore_test

import (
	"context"
	"crypto/sha256"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// The fingerprint migration upgrades a processed_event table of today's
// schema in place, on every database: rows written before it are plain
// duplicates (no fingerprint), new claims store the event name and the
// fingerprint, and a duplicate with other content is told apart.
func TestFingerprintMigrationUpgradesInPlace(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s, err := processedstore.NewStore(processedstore.Config{Dialect: tg.dialect})
		require.NoError(t, err)
		ms, err := s.Migrations()
		require.NoError(t, err)
		require.Equal(t, "0001_create_processed_event.up.sql", ms[0].Name)
		require.Equal(t, "0003_fingerprint.up.sql", ms[2].Name)

		// The schema before the fingerprint migration, and a row claimed
		// by the claim without verification.
		require.NoError(t, sqldb.Migrate(ctx, tg.db, tg.dialect, "processed:"+s.Table().String(), ms[:2]))
		old := uuid.Must(uuid.NewV7())
		tx, end := tg.begin(t)
		ok, err := s.Claim(ctx, tx, "stock", old)
		require.NoError(t, err)
		require.True(t, ok)
		end(true)

		// The upgrade, twice (idempotent).
		require.NoError(t, s.Migrate(ctx, tg.db))
		require.NoError(t, s.Migrate(ctx, tg.db))

		// The old row: a duplicate without a fingerprint.
		idA := processedstore.NewIdentity("order.placed", []byte(`{"order_id":1}`))
		tx, end = tg.begin(t)
		ok, err = s.ClaimIdentity(ctx, tx, "stock", old, idA)
		require.NoError(t, err)
		require.False(t, ok)
		stored, err := s.StoredIdentity(ctx, tx, "stock", old)
		require.NoError(t, err)
		require.True(t, stored.Found)
		require.Nil(t, stored.Fingerprint)
		require.Equal(t, processedstore.Unverified, idA.Verdict(stored))
		end(false)

		// A new event, claimed with its identity.
		id := uuid.Must(uuid.NewV7())
		tx, end = tg.begin(t)
		ok, err = s.ClaimIdentity(ctx, tx, "stock", id, idA)
		require.NoError(t, err)
		require.True(t, ok)
		end(true)
		done, err := s.Processed(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.True(t, done)

		tx, end = tg.begin(t)
		defer end(false)
		ok, err = s.ClaimIdentity(ctx, tx, "stock", id, idA)
		require.NoError(t, err)
		require.False(t, ok, "a duplicate")
		stored, err = s.StoredIdentity(ctx, tx, "stock", id)
		require.NoError(t, err)
		require.Equal(t, "order.placed", stored.EventName)
		require.Equal(t, idA.FingerprintBytes(), stored.Fingerprint)
		require.Equal(t, processedstore.SameEvent, idA.Verdict(stored))
		require.Equal(t, processedstore.OtherEvent, processedstore.NewIdentity("order.placed", []byte(`{"order_id":2}`)).Verdict(stored))
		require.Equal(t, processedstore.OtherEvent, processedstore.NewIdentity("order.cancelled", []byte(`{"order_id":1}`)).Verdict(stored))

		// The plain claim still works on the upgraded table (verification off).
		plain := uuid.Must(uuid.NewV7())
		ok, err = s.Claim(ctx, tx, "stock", plain)
		require.NoError(t, err)
		require.True(t, ok)
		stored, err = s.StoredIdentity(ctx, tx, "stock", plain)
		require.NoError(t, err)
		require.Equal(t, processedstore.Unverified, idA.Verdict(stored))

		// A long name is stored cut, at a character boundary; the
		// fingerprint covers all of it.
		long := strings.Repeat("é", 200)
		idLong := processedstore.NewIdentity(long, nil)
		lid := uuid.Must(uuid.NewV7())
		ok, err = s.ClaimIdentity(ctx, tx, "stock", lid, idLong)
		require.NoError(t, err)
		require.True(t, ok)
		stored, err = s.StoredIdentity(ctx, tx, "stock", lid)
		require.NoError(t, err)
		require.Equal(t, long[:processedstore.MaxStoredEventName-1], stored.EventName)
		require.Equal(t, processedstore.SameEvent, idLong.Verdict(stored))

		// No row at all (purged): nothing to compare.
		stored, err = s.StoredIdentity(ctx, tx, "stock", uuid.Must(uuid.NewV7()))
		require.NoError(t, err)
		require.False(t, stored.Found)
		require.Equal(t, processedstore.Unverified, idA.Verdict(stored))
	})
}

// The fingerprint separates name from payload, and carries its version.
func TestIdentityFingerprint(t *testing.T) {
	t.Parallel()
	a := processedstore.NewIdentity("ab", []byte("c"))
	b := processedstore.NewIdentity("a", []byte("bc"))
	require.NotEqual(t, a.FingerprintBytes(), b.FingerprintBytes())
	require.Len(t, a.FingerprintBytes(), 9)
	require.Equal(t, processedstore.FingerprintVersion, a.FingerprintBytes()[0])
	require.Equal(t, a.FingerprintBytes(), processedstore.NewIdentity("ab", []byte("c")).FingerprintBytes())
	other := append([]byte{processedstore.FingerprintVersion + 1}, b.FingerprintBytes()[1:]...)
	require.Equal(t, processedstore.Unverified, a.Verdict(processedstore.StoredIdentity{Found: true, Fingerprint: other}),
		"a fingerprint of another version is not compared")
}

// A row an earlier release claimed with a version-1 fingerprint (0x01 ‖ the
// whole SHA-256) stays verified after the upgrade, on every database: the
// same event is a duplicate, another payload under its id a conflict.
func TestVersionOneFingerprintRowsAreStillVerified(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)

		payload := []byte(`{"order_id":1}`)
		sum := sha256.Sum256(append([]byte{byte(len("order.placed"))}, append([]byte("order.placed"), payload...)...))
		v1 := append([]byte{1}, sum[:]...)
		old := uuid.Must(uuid.NewV7())
		tx, end := tg.begin(t)
		// The earlier release's claim: the same statement, its fingerprint.
		query, args := s.ClaimIdentityQuery("stock", old, processedstore.Identity{EventName: "order.placed", Fingerprint: v1})
		_, err := tx.Exec(ctx, query, args...)
		require.NoError(t, err)
		end(true)

		tx, end = tg.begin(t)
		defer end(false)
		same := processedstore.NewIdentity("order.placed", payload)
		ok, err := s.ClaimIdentity(ctx, tx, "stock", old, same)
		require.NoError(t, err)
		require.False(t, ok)
		stored, err := s.StoredIdentity(ctx, tx, "stock", old)
		require.NoError(t, err)
		require.Equal(t, v1, stored.Fingerprint)
		require.Equal(t, processedstore.SameEvent, same.Verdict(stored))
		require.Equal(t, processedstore.OtherEvent, processedstore.NewIdentity("order.placed", []byte(`{"order_id":2}`)).Verdict(stored))
		require.Equal(t, processedstore.OtherEvent, processedstore.NewIdentity("order.cancelled", payload).Verdict(stored))
	})
}

// StartAttemptUnlessProcessed counts an attempt of an event not processed
// yet, and for a processed one counts nothing and returns the stored
// identity, on every dialect and driver. A count ended in the claim's
// transaction (ForgetAttempts on it) is gone with its commit.
func TestStartAttemptUnlessProcessedCountsOnlyEventsNotProcessed(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		id := uuid.Must(uuid.NewV7())
		for want := 1; want <= 2; want++ {
			n, stored, sent, err := s.StartAttemptUnlessProcessed(ctx, tg.db, "stock", id)
			require.True(t, sent)
			require.NoError(t, err)
			require.False(t, stored.Found)
			require.Equal(t, want, n)
		}
		tx, end := tg.begin(t)
		ok, err := s.ClaimIdentity(ctx, tx, "stock", id, processedstore.NewIdentity("order.placed", []byte(`{}`)))
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, s.ForgetAttempts(ctx, tx, "stock", id))
		end(true)

		n, stored, sent, err := s.StartAttemptUnlessProcessed(ctx, tg.db, "stock", id)
		require.False(t, sent)
		require.NoError(t, err)
		require.True(t, stored.Found)
		require.Zero(t, n)
		require.Equal(t, "order.placed", stored.EventName)
		require.Equal(t, processedstore.SameEvent, processedstore.NewIdentity("order.placed", []byte(`{}`)).Verdict(stored))
		// The count the two attempts left was ended with the claim:
		// counting again starts at 1.
		n, err = s.StartAttempt(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.NoError(t, s.EndAttempt(ctx, tg.db, "stock", id))
	})
}

// EndAttempt ends one attempt, not every attempt counted: a copy of the
// event that fails beside a hung attempt (its claim waits for the hung
// one's) leaves the hung attempt's start counted, on every dialect and
// driver; the count at zero is deleted, and counting again starts at 1.
func TestEndAttemptEndsOneAttemptOnly(t *testing.T) {
	t.Parallel()
	eachTarget(t, func(t *testing.T, tg target) {
		ctx := context.Background()
		s := tg.store(t)
		id := uuid.Must(uuid.NewV7())
		for want := 1; want <= 3; want++ {
			n, err := s.StartAttempt(ctx, tg.db, "stock", id)
			require.NoError(t, err)
			require.Equal(t, want, n)
		}
		require.NoError(t, s.EndAttempt(ctx, tg.db, "stock", id))
		n, err := s.StartAttempt(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.Equal(t, 3, n, "an attempt's end forgot the other attempts' starts")
		for i := 0; i < 3; i++ {
			require.NoError(t, s.EndAttempt(ctx, tg.db, "stock", id))
		}
		require.NoError(t, s.EndAttempt(ctx, tg.db, "stock", id), "an end without a count")
		n, err = s.StartAttempt(ctx, tg.db, "stock", id)
		require.NoError(t, err)
		require.Equal(t, 1, n, "a count at zero was not deleted, or went below zero")
		require.NoError(t, s.ForgetAttempts(ctx, tg.db, "stock", id))
	})
}
