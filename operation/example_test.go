package operation_test

import (
	"encoding/json"
	"fmt"

	"github.com/watermill-idempotency/idempotency/operation"
)

// The key names the operation, from business identifiers only.
func ExampleNewKey() {
	k, _ := operation.NewKey("charge", "p-1")
	fmt.Println(k, k.Kind())
	partial, _ := operation.NewKey("refund", "p-1", "partial:2")
	fmt.Println(partial)
	// Output:
	// charge:p-1 charge
	// refund:p-1:partial%3A2
}

// Member order, spacing and number spelling do not change the fingerprint;
// a changed value does.
func ExampleFingerprint() {
	a, _ := operation.Fingerprint(map[string]any{"amount": 100, "currency": "EUR"})
	b, _ := operation.Fingerprint(json.RawMessage(`{"currency": "EUR", "amount": 1.00e2}`))
	c, _ := operation.Fingerprint(json.RawMessage(`{"currency": "EUR", "amount": 200}`))
	canonical, _ := operation.Canonical(json.RawMessage(`{"currency": "EUR", "amount": 100.50}`))
	fmt.Println(a == b, a == c)
	fmt.Println(string(canonical))
	// Output:
	// true false
	// {"amount":1005e-1,"currency":"EUR"}
}
