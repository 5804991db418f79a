package operation_test

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/operation"
)

func fp(t *testing.T, params any) string {
	t.Helper()
	f, err := operation.Fingerprint(params)
	require.NoError(t, err)
	require.Len(t, f, 64)
	return f
}

func TestFingerprintEqualities(t *testing.T) {
	t.Parallel()
	same := [][]string{
		{`1`, `1.0`, `1e0`, `10E-1`, `0.1e1`, `1.000e+0`, `100e-2`},
		{`0`, `-0`, `0.000`, `0e5`, `-0.0e-3`},
		{`100`, `1e2`, `1E+2`, `100.00`, `0.001e5`},
		{`-2.5`, `-25e-1`, `-0.25e1`},
		{`{"a":1,"b":[1,2]}`, `{ "b" : [ 1 , 2.0 ] , "a" : 1 }`, "{\n\t\"b\":[1e0,2],\"a\":10e-1}"},
		{`"é"`, `"\u00e9"`},
		{`"<&>"`, `"\u003c\u0026\u003e"`},
		{`{"a":"x"}`, `{"\u0061":"x"}`},
	}
	for _, group := range same {
		want := fp(t, json.RawMessage(group[0]))
		for _, s := range group[1:] {
			require.Equal(t, want, fp(t, json.RawMessage(s)), "%s vs %s", group[0], s)
		}
	}
	differ := [][2]string{
		{`100`, `"100"`},
		{`{"a":null}`, `{}`},
		{`false`, `null`},
		{`[]`, `{}`},
		{`[1,2]`, `[2,1]`},
		{`0.1`, `0.1000000000000000000001`},
		{`9007199254740993`, `9007199254740992`},
		{`"é"`, "\"e\u0301\""}, // NFC vs NFD: no normalisation
		{`"a"`, `"A"`},
		{`{"amount":100,"currency":"EUR"}`, `{"amount":200,"currency":"EUR"}`},
	}
	for _, d := range differ {
		require.NotEqual(t, fp(t, json.RawMessage(d[0])), fp(t, json.RawMessage(d[1])), "%s vs %s", d[0], d[1])
	}

	// Go values go through encoding/json first.
	type req struct {
		Currency string `json:"currency"`
		Amount   int    `json:"amount"`
	}
	require.Equal(t, fp(t, req{"EUR", 100}), fp(t, map[string]any{"amount": 100.0, "currency": "EUR"}))
	c, err := operation.Canonical(req{"EUR", 100})
	require.NoError(t, err)
	require.Equal(t, `{"amount":1e2,"currency":"EUR"}`, string(c))

	for _, bad := range []string{``, `{`, `{"a":1}x`, `{"a":1,"a":2}`, `1e9999999999`, "\"\xff\"", `[1,]`} {
		_, err := operation.Fingerprint(json.RawMessage(bad))
		require.ErrorIs(t, err, operation.ErrInvalidParams, "%q", bad)
	}
	_, err = operation.Fingerprint(func() {})
	require.ErrorIs(t, err, operation.ErrInvalidParams)
}

// Property: whatever the member order, whitespace and spelling of equal
// numbers, one value has one fingerprint; and changing any one leaf value,
// adding or removing a member, or swapping two distinct array elements gives
// another.
func TestFingerprintProperty(t *testing.T) {
	t.Parallel()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	for i := range 300 {
		v := genValue(rng, 3)
		want := fp(t, json.RawMessage(render(rng, v)))
		for range 4 {
			text := render(rng, v)
			require.Equal(t, want, fp(t, json.RawMessage(text)), "iteration %d: %s", i, text)
		}
		if m, ok := mutate(rng, v); ok {
			text := render(rng, m)
			require.NotEqual(t, want, fp(t, json.RawMessage(text)), "iteration %d: mutation %s of %s", i, text, render(rng, v))
		}
	}
}

// A generated JSON value: nil, bool, string, num (an exact decimal
// coefficient × 10^exp), []any or map[string]any.
type num struct {
	coef int64
	exp  int
}

func genValue(rng *rand.Rand, depth int) any {
	k := rng.IntN(7)
	if depth == 0 {
		k = rng.IntN(4)
	}
	switch k {
	case 0:
		return nil
	case 1:
		return rng.IntN(2) == 0
	case 2:
		return []string{"", "EUR", "é", "a b", `q"uote`, "\u2028", "<&>", "p-1"}[rng.IntN(8)] + strconv.Itoa(rng.IntN(3))
	case 3:
		return num{coef: rng.Int64N(2001) - 1000, exp: rng.IntN(7) - 3}
	case 4:
		n := rng.IntN(4)
		arr := make([]any, n)
		for i := range arr {
			arr[i] = genValue(rng, depth-1)
		}
		return arr
	default:
		n := rng.IntN(5)
		obj := map[string]any{}
		for range n {
			obj[[]string{"amount", "currency", "id", "x", "é", "a\"b", "nested"}[rng.IntN(7)]+strconv.Itoa(rng.IntN(2))] = genValue(rng, depth-1)
		}
		return obj
	}
}

func ws(rng *rand.Rand) string {
	return []string{"", "", " ", "\n", "\t", "  \r\n "}[rng.IntN(6)]
}

// spellNum writes coef×10^exp in one of several exact spellings.
func spellNum(rng *rand.Rand, n num) string {
	neg := n.coef < 0
	digits := strconv.FormatInt(n.coef, 10)
	digits = strings.TrimPrefix(digits, "-")
	sign := ""
	if neg {
		sign = "-"
	}
	if n.coef == 0 {
		if rng.IntN(2) == 0 {
			sign = "-" // -0 equals 0
		}
		return sign + []string{"0", "0.0", "0e5", "0.000E-2", "0e+0"}[rng.IntN(5)]
	}
	switch rng.IntN(4) {
	case 0: // coefficient and exponent as they are, padded with zeros
		pad := rng.IntN(3)
		return sign + digits + strings.Repeat("0", pad) + []string{"e", "E"}[rng.IntN(2)] + strconv.Itoa(n.exp-pad)
	case 1: // positional decimal
		return sign + positional(digits, n.exp) + strings.Repeat("0", boolInt(strings.Contains(positional(digits, n.exp), "."))*rng.IntN(3))
	case 2: // 0.digits e(exp+len)
		e := n.exp + len(digits)
		plus := ""
		if e >= 0 && rng.IntN(2) == 0 {
			plus = "+"
		}
		return sign + "0." + digits + "e" + plus + strconv.Itoa(e)
	default: // scientific with one leading digit
		lead, rest := digits[:1], digits[1:]
		if rest == "" {
			return sign + lead + "e" + strconv.Itoa(n.exp)
		}
		return sign + lead + "." + rest + "E" + strconv.Itoa(n.exp+len(rest))
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// positional renders digits×10^exp without an exponent.
func positional(digits string, exp int) string {
	if exp >= 0 {
		return digits + strings.Repeat("0", exp)
	}
	frac := -exp
	if len(digits) <= frac {
		return "0." + strings.Repeat("0", frac-len(digits)) + digits
	}
	return digits[:len(digits)-frac] + "." + digits[len(digits)-frac:]
}

// render writes v as JSON with random member order, whitespace, string
// escapes and number spellings.
func render(rng *rand.Rand, v any) string {
	var b strings.Builder
	b.WriteString(ws(rng))
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(x))
	case string:
		b.WriteString(spellString(rng, x))
	case num:
		b.WriteString(spellNum(rng, x))
	case []any:
		b.WriteString("[")
		for i, e := range x {
			if i > 0 {
				b.WriteString(ws(rng) + ",")
			}
			b.WriteString(render(rng, e))
		}
		b.WriteString(ws(rng) + "]")
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		b.WriteString("{")
		for i, k := range keys {
			if i > 0 {
				b.WriteString(ws(rng) + ",")
			}
			b.WriteString(ws(rng) + spellString(rng, k) + ws(rng) + ":" + render(rng, x[k]))
		}
		b.WriteString(ws(rng) + "}")
	}
	b.WriteString(ws(rng))
	return b.String()
}

// spellString writes s as a JSON string, escaping each character as \uXXXX
// at random.
func spellString(rng *rand.Rand, s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteString(`\` + string(r))
		case r < 0x20 || r > 0xFFFF || rng.IntN(3) == 0 && r <= 0xFFFF:
			if r > 0xFFFF {
				b.WriteRune(r)
				continue
			}
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// mutate returns a copy of v with exactly one change that alters its value,
// or false when v offers none (an empty container at the root is replaced).
func mutate(rng *rand.Rand, v any) (any, bool) {
	switch x := v.(type) {
	case nil:
		return false, true
	case bool:
		return !x, true
	case string:
		return x + "!", true
	case num:
		if x.coef == 0 {
			return num{coef: 1, exp: x.exp}, true
		}
		return num{coef: x.coef + 1, exp: x.exp}, true
	case []any:
		if len(x) == 0 || rng.IntN(4) == 0 {
			return append(append([]any(nil), x...), nil), true // one more element
		}
		i := rng.IntN(len(x))
		m, ok := mutate(rng, x[i])
		if !ok {
			return nil, false
		}
		out := append([]any(nil), x...)
		out[i] = m
		return out, true
	case map[string]any:
		out := map[string]any{}
		for k, e := range x {
			out[k] = e
		}
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		switch {
		case len(keys) == 0 || rng.IntN(4) == 0:
			out["added"+strconv.Itoa(len(keys))] = nil // one more member
		case rng.IntN(3) == 0:
			delete(out, keys[rng.IntN(len(keys))])
		default:
			k := keys[rng.IntN(len(keys))]
			m, ok := mutate(rng, x[k])
			if !ok {
				return nil, false
			}
			out[k] = m
		}
		return out, true
	}
	return nil, false
}
