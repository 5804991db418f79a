package operation_test

import (
	"context"
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/operation"
)

// unstorable is text PostgreSQL (22021) refuses in a text column, and
// MySQL/MariaDB in strict mode (1366) in a utf8mb4 one: a byte that is not
// UTF-8 and a NUL (PostgreSQL). A provider's error body or reference in
// another encoding carries such bytes.
const unstorable = "Kartenprüfung \xfcberfällig \x00 [\xff]"

// An outcome whose error text or reference holds text the database cannot
// store (not UTF-8, NUL) is recorded all the same, the same way on every
// database: a charge that went through is recorded as succeeded (not left
// started, then uncertain, then reconciled and refused again in a loop), a
// transient error gives the key back, a rejection is final, a timeout is
// uncertain at once. What is stored, and returned afterwards, is valid
// UTF-8 without NUL (SQLite used to keep the bytes as they were).
func TestOutcomeWithTextTheDatabaseCannotStoreIsRecorded(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		r := e.r
		get := func(t *testing.T, k operation.Key) operation.Record {
			t.Helper()
			rec, err := r.Get(ctx, k)
			require.NoError(t, err)
			require.True(t, utf8.ValidString(rec.Error), "error text %q", rec.Error)
			require.NotContains(t, rec.Error, "\x00")
			require.True(t, utf8.ValidString(rec.Reference), "reference %q", rec.Reference)
			require.NotContains(t, rec.Reference, "\x00")
			return rec
		}
		fail := func(wrap func(error) error) operation.CallFunc {
			return func(context.Context, string) (operation.Result, error) {
				return operation.Result{}, wrap(errors.New("provider: " + unstorable))
			}
		}

		t.Run("success with such a reference is recorded, then replayed without a call", func(t *testing.T) {
			k := mustKey(t, "charge", "reference")
			calls := 0
			call := func(context.Context, string) (operation.Result, error) {
				calls++
				return operation.Result{Reference: "ch_" + unstorable, Data: []byte{0xff, 0x00}}, nil
			}
			res, err := r.Do(ctx, k, eur100, call)
			require.NoError(t, err, "the charge went through: its outcome must be recorded")
			require.Equal(t, operation.OriginCall, res.Origin)
			rec := get(t, k)
			require.Equal(t, operation.StateSucceeded, rec.State)
			require.Equal(t, res.Reference, rec.Reference, "the reference returned is the one recorded")
			again, err := r.Do(ctx, k, eur100, call)
			require.NoError(t, err)
			require.Equal(t, operation.OriginStored, again.Origin)
			require.Equal(t, res.Reference, again.Reference)
			require.Equal(t, []byte{0xff, 0x00}, again.Data, "Data is bytes: kept as they are")
			require.Equal(t, 1, calls)
		})

		t.Run("a transient error with such text gives the key back", func(t *testing.T) {
			k := mustKey(t, "charge", "transient")
			_, err := r.Do(ctx, k, eur100, fail(operation.Transient))
			require.True(t, inbox.IsTransient(err))
			require.NotErrorIs(t, err, operation.ErrNotRecorded)
			rec := get(t, k)
			require.Equal(t, operation.StateStarted, rec.State)
			require.Empty(t, rec.Owner, "no call in flight: the retry calls again")
			require.Contains(t, rec.Error, "Kartenprüfung")
			p := newProvider()
			res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"))
			require.NoError(t, err)
			require.Equal(t, operation.OriginCall, res.Origin)
		})

		t.Run("a rejection with such text is final", func(t *testing.T) {
			k := mustKey(t, "charge", "rejected")
			_, err := r.Do(ctx, k, eur100, fail(operation.Rejected))
			require.ErrorIs(t, err, operation.ErrFailed)
			require.Equal(t, operation.StateFailed, get(t, k).State)
			p := newProvider()
			_, err = r.Do(ctx, k, eur100, p.call("100", "EUR"))
			var failed *operation.FailedError
			require.ErrorAs(t, err, &failed, "the recorded rejection, not an uncertain outcome")
			require.Contains(t, failed.Reason, "Kartenprüfung")
			_, calls, _ := p.counts()
			require.Zero(t, calls)
		})

		t.Run("a timeout with such text is uncertain at once", func(t *testing.T) {
			k := mustKey(t, "charge", "timeout")
			_, err := r.Do(ctx, k, eur100, func(context.Context, string) (operation.Result, error) {
				return operation.Result{Reference: "req_" + unstorable}, operation.Timeout(errors.New(unstorable))
			})
			var u *operation.UncertainError
			require.ErrorAs(t, err, &u)
			rec := get(t, k)
			require.Equal(t, operation.StateUncertain, rec.State)
			require.Equal(t, rec.Reference, u.Reference)

			// Reconciled with such a reference: recorded as succeeded.
			reconcile := func(context.Context, operation.Record) (operation.Result, error) {
				return operation.Result{Reference: "ch_" + unstorable}, nil
			}
			p := newProvider()
			res, err := r.Do(ctx, k, eur100, p.call("100", "EUR"), operation.WithReconcile(reconcile))
			require.NoError(t, err)
			require.Equal(t, operation.OriginReconciled, res.Origin)
			rec = get(t, k)
			require.Equal(t, operation.StateSucceeded, rec.State)
			require.Equal(t, res.Reference, rec.Reference)
			_, calls, _ := p.counts()
			require.Zero(t, calls)
		})

		t.Run("a verdict with such text is recorded", func(t *testing.T) {
			for i, v := range []operation.Verdict{
				operation.VerdictSucceeded(operation.Result{Reference: "ch_" + unstorable}),
				operation.VerdictFailed(unstorable),
				operation.VerdictNotExecuted(unstorable),
			} {
				k := mustKey(t, "charge", "verdict", string(rune('a'+i)))
				_, err := r.Do(ctx, k, eur100, fail(operation.Timeout))
				require.ErrorIs(t, err, operation.ErrUncertain)
				require.NoError(t, r.Resolve(ctx, k, v))
				require.NotEqual(t, operation.StateUncertain, get(t, k).State)
			}
		})
	})
}
