// Package door lets the library's own test helpers (idempotencytest) run a
// message through a middleware.Consumer's whole chain without a router.
package door

import "github.com/ThreeDotsLabs/watermill/message"

// Wrap is set by package middleware: it returns h inside consumer's chain,
// attaching consumer to the handler named name (as AddHandler does).
var Wrap func(consumer any, name string, h message.HandlerFunc) (message.HandlerFunc, error)
