package mysqlerr_test

import (
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/middleware/mysqlerr"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	for n, want := range map[uint16]inbox.Class{
		1205: inbox.ClassTransient, 1213: inbox.ClassTransient, 1290: inbox.ClassTransient,
		1792: inbox.ClassTransient, 2013: inbox.ClassTransient, 1021: inbox.ClassTransient,
		1146: inbox.ClassConfiguration, 1054: inbox.ClassConfiguration, 1142: inbox.ClassConfiguration,
		1062: inbox.ClassOrdinary, 1064: inbox.ClassOrdinary,
	} {
		require.Equal(t, want, mysqlerr.Classify(fmt.Errorf("wrapped: %w", &mysql.MySQLError{Number: n})), n)
	}
	require.Equal(t, inbox.ClassOrdinary, mysqlerr.Classify(io.EOF), "not a MySQL error")
	require.Equal(t, inbox.ClassOrdinary, mysqlerr.Classify(mysql.ErrInvalidConn), "connection state is decided by origin")
	require.True(t, mysqlerr.IsTransient(&mysql.MySQLError{Number: 1213}))
	require.False(t, mysqlerr.IsTransient(inbox.Permanent(&mysql.MySQLError{Number: 1213})), "permanent wins")
	require.False(t, mysqlerr.IsTransient(errors.New("Error 1213: Deadlock found")), "never by message text")
}

// TestIsTransientDeadlockAndLockWait: deadlock (1213) and lock wait timeout
// (1205) are transient, wrapped or not; a duplicate key (1062) is not.
func TestIsTransientDeadlockAndLockWait(t *testing.T) {
	t.Parallel()
	require.True(t, mysqlerr.IsTransient(fmt.Errorf("wrapped: %w", &mysql.MySQLError{Number: 1213})))
	require.True(t, mysqlerr.IsTransient(&mysql.MySQLError{Number: 1205}))
	require.False(t, mysqlerr.IsTransient(&mysql.MySQLError{Number: 1062}))
}
