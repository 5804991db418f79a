package shop_test

import _ "github.com/watermill-idempotency/idempotency/internal/testdeps" // the SQLite and MySQL drivers testenv opens
