package operation_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// A time.Time, or an RFC 3339 string, fingerprints as the instant it denotes,
// whatever its offset or zone (pgx returns timestamptz values in the local
// zone of the process).
func TestFingerprintTimeOffsetsAreOneInstant(t *testing.T) {
	t.Parallel()
	paris, err := time.LoadLocation("Europe/Paris")
	require.NoError(t, err)
	utc := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
	type req struct {
		Amount int        `json:"amount"`
		At     time.Time  `json:"at"`
		Due    *time.Time `json:"due,omitempty"`
	}
	inParis := utc.In(paris)
	require.Equal(t, 12, inParis.Hour())
	plus2 := time.Date(2024, 7, 1, 12, 0, 0, 0, time.FixedZone("", 2*3600))
	minus5 := utc.In(time.FixedZone("EST", -5*3600))
	want := fp(t, req{100, utc, &utc})
	for _, at := range []time.Time{inParis, plus2, minus5, utc.Local()} {
		require.Equal(t, want, fp(t, req{100, at, &at}), at.String())
	}
	require.Equal(t, fp(t, map[string]any{"at": utc}), fp(t, map[string]any{"at": plus2}))

	// Full precision: one nanosecond apart is another request.
	require.NotEqual(t, want, fp(t, req{100, utc.Add(time.Nanosecond), &utc}))

	// JSON text: the same, for strings that are RFC 3339 date-times.
	same := []string{`"2024-07-01T12:00:00+02:00"`, `"2024-07-01T10:00:00Z"`, `"2024-07-01T10:00:00.000Z"`,
		`"2024-07-01t10:00:00z"`, `"2024-07-01T05:00:00.000000000-05:00"`}
	for _, s := range same[1:] {
		require.Equal(t, fp(t, json.RawMessage(same[0])), fp(t, json.RawMessage(s)), s)
	}
	c, err := operation.Canonical(json.RawMessage(`{"at":"2024-07-01T12:00:00.120+02:00"}`))
	require.NoError(t, err)
	require.Equal(t, `{"at":"2024-07-01T10:00:00.12Z"}`, string(c))
	// Other strings stay text, even when they look like a date.
	for _, s := range []string{`"2024-07-01"`, `"2024-07-01 10:00:00Z"`, `"2016-12-31T23:59:60Z"`,
		`"2024-07-01T10:00:00.1234567891Z"`, `"2024-07-01T10:00:00+24:00"`, `"0000-01-01T00:30:00+01:00"`} {
		c, err := operation.Canonical(json.RawMessage(s))
		require.NoError(t, err)
		require.Equal(t, s, string(c))
	}
}

// TZ=Europe/Paris in a child process: a timestamptz read back through pgx
// (in the process's local zone) fingerprints as the same instant in UTC.
func TestFingerprintUnderParisTimeZone(t *testing.T) {
	if os.Getenv("OPERATION_TZ_CHILD") == "1" {
		return // the child's work is in TestFingerprintTimeZoneChild
	}
	t.Parallel()
	cmd := exec.Command(os.Args[0], "-test.run=^TestFingerprintTimeZoneChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "TZ=Europe/Paris", "OPERATION_TZ_CHILD=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	var zone, got string
	for _, line := range strings.Split(string(out), "\n") {
		if z, ok := strings.CutPrefix(line, "zone="); ok {
			zone = z
		}
		if f, ok := strings.CutPrefix(line, "fingerprint="); ok {
			got = f
		}
	}
	require.Equal(t, "CEST +7200", zone, "the child ran in Paris time: %s", out)
	want, err := operation.Fingerprint(map[string]any{"amount": 100, "at": time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)})
	require.NoError(t, err)
	require.Equal(t, want, got, "%s", out)
}

// TestFingerprintTimeZoneChild is the child process of
// TestFingerprintUnderParisTimeZone, not a test of its own: without its
// environment it returns at once.
func TestFingerprintTimeZoneChild(t *testing.T) {
	if os.Getenv("OPERATION_TZ_CHILD") != "1" {
		return
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.PostgresURL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	var at time.Time
	require.NoError(t, conn.QueryRow(ctx, `SELECT timestamptz '2024-07-01 10:00:00+00'`).Scan(&at))
	name, off := at.Zone()
	f, err := operation.Fingerprint(map[string]any{"amount": 100, "at": at})
	require.NoError(t, err)
	fmt.Printf("zone=%s %+d\nfingerprint=%s\n", name, off, f)
}

type badText struct{}

func (badText) MarshalText() ([]byte, error) { return []byte("DE89\xff"), nil }

// Text that is not valid is refused, never replaced by U+FFFD (which made
// "DE89\xff" and "DE89\xfe" one request).
func TestFingerprintRefusesInvalidText(t *testing.T) {
	t.Parallel()
	type account struct {
		IBAN  string `json:"iban"`
		Owner string `json:"owner"`
	}
	type wrapped struct {
		Accounts []account `json:"accounts"`
	}
	for name, params := range map[string]any{
		"string":          "DE89\xff",
		"other string":    "DE89\xfe",
		"struct field":    account{IBAN: "DE89\xff", Owner: "a"},
		"nested slice":    wrapped{Accounts: []account{{IBAN: "ok"}, {IBAN: "DE89\xfe"}}},
		"map value":       map[string]any{"iban": "DE89\xff"},
		"map key":         map[string]int{"ib\xffan": 1},
		"pointer":         &account{Owner: "\xc3"},
		"any slice":       []any{1, "x\xff"},
		"text marshaler":  map[string]any{"t": badText{}},
		"raw invalid":     json.RawMessage("\"DE89\xff\""),
		"raw lone high":   json.RawMessage(`{"iban":"DE89\ud800"}`),
		"raw lone low":    json.RawMessage(`"\udc00"`),
		"raw unpaired":    json.RawMessage(`"\ud800\u0041"`),
		"raw in key":      json.RawMessage(`{"\udbff":1}`),
		"bytes invalid":   []byte("\"\xfe\""),
		"raw number next": json.RawMessage(`["\ud83d",1]`),
	} {
		_, err := operation.Fingerprint(params)
		require.ErrorIs(t, err, operation.ErrInvalidParams, name)
		_, err = operation.Canonical(params)
		require.ErrorIs(t, err, operation.ErrInvalidParams, name)
	}
	_, err := operation.Fingerprint(account{IBAN: "DE89\xff"})
	require.ErrorContains(t, err, ".IBAN")
	require.NotContains(t, err.Error(), "DE89", "the value is not quoted")

	// Valid text in every spelling stays accepted: escaped pairs, an escaped
	// backslash before "u", []byte values (base64), unexported fields
	// (not encoded).
	type quiet struct {
		Name   string `json:"name"`
		secret string
		Skip   string `json:"-"`
		Raw    []byte `json:"raw"`
	}
	for _, ok := range []any{
		json.RawMessage(`"\ud83d\ude00"`), json.RawMessage(`"\\ud800"`), "😀",
		quiet{Name: "é", secret: "\xff", Skip: "\xff", Raw: []byte{0xff}},
	} {
		_, err := operation.Fingerprint(ok)
		require.NoError(t, err, "%#v", ok)
	}
	require.Equal(t, fp(t, json.RawMessage(`"\ud83d\ude00"`)), fp(t, "😀"))
}

// v1fingerprint is how fingerprints were computed before versions existed
// (SHA-256 hex of the canonical text, no prefix), for records stored then.
func v1fingerprint(canonical string) string {
	sum := sha256.Sum256([]byte(canonical))
	return hex.EncodeToString(sum[:])
}

// Fingerprints carry their version; a stored fingerprint is compared with
// the algorithm of its version, so records written before versions existed
// keep matching, and a newer version never turns into a conflict.
func TestFingerprintVersions(t *testing.T) {
	t.Parallel()
	params := map[string]any{"amount": 100, "currency": "EUR"}
	f := fp(t, params)
	require.True(t, strings.HasPrefix(f, "v2:"), f)
	require.Equal(t, 2, operation.FingerprintVersion)

	old := v1fingerprint(`{"amount":1e2,"currency":"EUR"}`)
	for stored, want := range map[string]bool{
		f:   true,
		old: true, // version 1, same request
		v1fingerprint(`{"amount":2e2,"currency":"EUR"}`):        false, // version 1, other request
		fp(t, map[string]any{"amount": 200, "currency": "EUR"}): false,
		"v3:" + strings.Repeat("0", 61):                         true, // a later version: accepted
		"v12:anything":                                          true,
		"v2:" + strings.Repeat("0", 61):                         false,
		"v1:" + old[:61]:                                        false,
		"v02:x":                                                 false,
		"garbage":                                               false,
		"":                                                      false,
		strings.ToUpper(old):                                    false,
	} {
		got, err := operation.SameRequest(stored, params)
		require.NoError(t, err)
		require.Equal(t, want, got, "stored %q", stored)
	}
	_, err := operation.SameRequest(old, "\xff")
	require.ErrorIs(t, err, operation.ErrInvalidParams)
}

// Through the Runner, on every database: a charge recorded with its time in
// Paris is the same request when redelivered with the time in UTC (no
// ConflictError, no second call), and a record written before versions
// existed keeps matching its request.
func TestRunFingerprintTimeZoneAndVersion(t *testing.T) {
	t.Parallel()
	eachRunner(t, operation.Config{Table: "ops"}, func(t *testing.T, e *runnerEnv) {
		ctx := context.Background()
		paris, err := time.LoadLocation("Europe/Paris")
		require.NoError(t, err)
		at := time.Date(2024, 7, 1, 10, 0, 0, 0, time.UTC)
		p := newProvider()
		key := mustKey(t, "charge", "p-1")
		_, err = e.r.Do(ctx, key, map[string]any{"amount": "10.00", "at": at.In(paris)}, p.call("10.00", "EUR"))
		require.NoError(t, err)
		res, err := e.r.Do(ctx, key, map[string]any{"amount": "10.00", "at": at}, p.call("10.00", "EUR"))
		require.NoError(t, err)
		require.Equal(t, operation.OriginStored, res.Origin)
		_, err = e.r.Do(ctx, key, map[string]any{"amount": "10.00", "at": at.Add(time.Millisecond)}, p.call("10.00", "EUR"))
		var conflict *operation.ConflictError
		require.True(t, errors.As(err, &conflict), "%v", err)
		_, calls, _ := p.counts()
		require.Equal(t, 1, calls)

		// A record of version 1, as stored before versions existed.
		key2 := mustKey(t, "charge", "p-2")
		e.Exec(t, e.Rebind(`INSERT INTO ops (`+e.Quote("key")+`, kind, fingerprint, state, reference) VALUES ($1, 'charge', $2, 'succeeded', 'ch-old')`),
			key2.String(), v1fingerprint(`{"amount":"10.00","currency":"EUR"}`))
		res, err = e.r.Do(ctx, key2, map[string]any{"currency": "EUR", "amount": "10.00"}, p.call("10.00", "EUR"))
		require.NoError(t, err)
		require.Equal(t, operation.OriginStored, res.Origin)
		require.Equal(t, "ch-old", res.Reference)
		_, err = e.r.Do(ctx, key2, map[string]any{"currency": "EUR", "amount": "11.00"}, p.call("11.00", "EUR"))
		require.True(t, errors.As(err, &conflict), "%v", err)
		_, calls, _ = p.counts()
		require.Equal(t, 1, calls)
	})
}
