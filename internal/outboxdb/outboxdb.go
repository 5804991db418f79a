// Package outboxdb lets package middleware read the database an
// outbox.Outbox was built on (outbox.Config.DB), which the outbox's
// exported API does not show: a consumer refuses an outbox whose SQL its
// attempts' transactions could not run.
package outboxdb

import "github.com/watermill-idempotency/idempotency/internal/sqldb"

// HandleOf is set by package outbox: it returns the handle an
// *outbox.Outbox was built on, or nil for any other value (a nil pointer,
// an Outbox that outbox.New did not return).
var HandleOf func(outbox any) *sqldb.Handle
