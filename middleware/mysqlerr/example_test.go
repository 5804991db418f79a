package mysqlerr_test

import (
	"fmt"

	"github.com/go-sql-driver/mysql"

	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// Classify by MySQL error number, never by message text: a deadlock is
// transient (the attempt is held and re-run), a missing table is a
// configuration error. Set it as middleware.ConsumerConfig.Classifier on MySQL or
// MariaDB.
func ExampleClassify() {
	_ = middleware.ConsumerConfig{Classifier: mysqlerr.Classify}
	deadlock := &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock"}
	missing := fmt.Errorf("reserve: %w", &mysql.MySQLError{Number: 1146, Message: "Table 'shop.reservation' doesn't exist"})
	fmt.Println(mysqlerr.Classify(deadlock) == middleware.ClassTransient, mysqlerr.IsTransient(deadlock))
	fmt.Println(mysqlerr.Classify(missing) == middleware.ClassConfiguration)
	// Output:
	// true true
	// true
}
