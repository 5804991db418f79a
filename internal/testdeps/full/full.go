// Package full imports what the core module's _*_test.go files import and
// the core must not require, so that `go mod tidy` keeps these requirements
// in internal/testdeps/go.mod and the workspace provides them to the core's
// full test run (scripts/test.sh). Nothing imports this package.
package full

import (
	_ "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	_ "github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	_ "github.com/golang-migrate/migrate/v4/source/iofs"
	_ "github.com/pressly/goose/v3"
	_ "github.com/rabbitmq/amqp091-go"
	_ "github.com/redis/go-redis/v9"

	_ "github.com/watermill-idempotency/idempotency/internal/testdeps"
	_ "github.com/watermill-idempotency/idempotency/marshaler/amqp"
	_ "github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
	_ "github.com/watermill-idempotency/idempotency/versioned/redislatest"
)
