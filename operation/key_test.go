package operation_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/operation"
)

func TestKey(t *testing.T) {
	t.Parallel()
	k := mustKey(t, "charge", "p-1")
	require.Equal(t, "charge:p-1", k.String())
	require.Equal(t, "charge", k.Kind())
	require.Equal(t, k, mustKey(t, "charge", "p-1"), "deterministic")
	require.Equal(t, "refund:p-1:partial-2", mustKey(t, "refund", "p-1", "partial-2").String())

	// Escaping keeps different tuples apart.
	a := mustKey(t, "x", "a:b", "c")
	b := mustKey(t, "x", "a", "b:c")
	require.NotEqual(t, a, b)
	require.Equal(t, "x:a%3Ab:c", a.String())
	require.Equal(t, "x:100%25:caf\u00e9:tab%09", mustKey(t, "x", "100%", "caf\u00e9", "tab\t").String())

	for _, k := range []operation.Key{k, a, b, mustKey(t, "email.confirmation", "o-42", "%:%")} {
		got, err := operation.ParseKey(k.String())
		require.NoError(t, err)
		require.Equal(t, k, got)
	}

	for _, bad := range [][]string{
		{"", "p-1"}, {"Charge", "p-1"}, {"charge:x", "p-1"}, {"charge", ""}, {"charge", "p-1", ""},
		{"charge", "\xff"}, {"charge", strings.Repeat("x", operation.MaxKeyLen)},
	} {
		_, err := operation.NewKey(bad[0], bad[1], bad[2:]...)
		require.ErrorIs(t, err, operation.ErrInvalidKey, "%q", bad)
	}
	for _, bad := range []string{"", "charge", "charge:", "charge:a%3ab", "charge:a%3", "charge:a%zz", "Charge:p-1", "charge:%FF"} {
		_, err := operation.ParseKey(bad)
		require.ErrorIs(t, err, operation.ErrInvalidKey, "%q", bad)
	}
	require.True(t, operation.Key{}.IsZero())
	require.Panics(t, func() { operation.MustKey("", "x") })
}
