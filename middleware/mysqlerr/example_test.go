package mysqlerr_test

import (
	"fmt"

	"github.com/go-sql-driver/mysql"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

// Classify by MySQL error number, never by message text: a deadlock is
// transient (the attempt is held and re-run), a missing table is a
// configuration error. Set it as inbox.Config.Classifier on MySQL or
// MariaDB.
func ExampleClassify() {
	_ = inbox.Config{Classifier: mysqlerr.Classify}
	deadlock := &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock"}
	missing := fmt.Errorf("reserve: %w", &mysql.MySQLError{Number: 1146, Message: "Table 'shop.reservation' doesn't exist"})
	fmt.Println(mysqlerr.Classify(deadlock) == inbox.ClassTransient, mysqlerr.IsTransient(deadlock))
	fmt.Println(mysqlerr.Classify(missing) == inbox.ClassConfiguration)
	// Output:
	// true true
	// true
}
