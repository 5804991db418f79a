package versioned_test

import "github.com/watermill-idempotency/idempotency/middleware/mysqlerr"

func init() { mysqlTransient = mysqlerr.IsTransient }
