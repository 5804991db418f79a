package shop

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// Event names: "<service>.<aggregate>.<event>.v<version>". They are the
// envelope's event_name, the Watermill topic the producer publishes on and
// the AMQP routing key consumer queues are bound by.
const (
	// EventOrderPlaced: payload OrderPlaced.
	EventOrderPlaced = "order.order.placed.v1"
	// EventOrderStatusChanged: payload OrderStatusChanged.
	EventOrderStatusChanged = "order.order.status_changed.v1"
)

// OrderLine is one line of an order.
type OrderLine struct {
	// LineNo numbers the lines of one order from 1.
	LineNo int `json:"line_no"`
	// SKU identifies the product.
	SKU string `json:"sku"`
	// Quantity is a decimal string with up to 3 fractional digits, e.g.
	// "2.000" or "0.250": never a JSON number, so no float ever rounds it.
	Quantity string `json:"quantity"`
}

// OrderPlaced is the payload of EventOrderPlaced. Version is the order row's
// version after the change (1 for a new order).
type OrderPlaced struct {
	OrderID string      `json:"order_id"`
	Version int64       `json:"version"`
	Status  string      `json:"status"`
	Lines   []OrderLine `json:"lines"`
}

// OrderStatusChanged is the payload of EventOrderStatusChanged: the order's
// full status (a snapshot, not a delta) at Version, which the producer
// increments in the transaction that writes the outbox row.
type OrderStatusChanged struct {
	OrderID string `json:"order_id"`
	Version int64  `json:"version"`
	Status  string `json:"status"`
}

// quantityRE is the quantity grammar: up to 9 integer digits, optionally a
// point and 1 to 3 fractional digits (numeric(12,3)).
var quantityRE = regexp.MustCompile(`^[0-9]{1,9}(\.[0-9]{1,3})?$`)

// ErrBadQuantity is returned (wrapped) by ValidateQuantity.
var ErrBadQuantity = errors.New("shop: quantity must be a positive decimal string with at most 9 integer and 3 fractional digits")

// ValidateQuantity checks q against the OrderLine.Quantity grammar ("2",
// "2.000", "0.25"; not "", "-1", "1e3", "2.0001", "0") and returns an error
// wrapping ErrBadQuantity otherwise. The string goes to PostgreSQL as is and
// is cast to numeric there, never through a float.
func ValidateQuantity(q string) error {
	if !quantityRE.MatchString(q) || strings.Trim(q, "0.") == "" {
		return fmt.Errorf("%w: %q", ErrBadQuantity, q)
	}
	return nil
}
