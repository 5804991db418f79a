package operation

// Test-only exports for the external test package.

const (
	CrashAfterBegin = crashAfterBegin
	CrashAfterCall  = crashAfterCall
)

// LockID is the advisory lock number of k.
func LockID(k Key) int64 { return lockID(k) }
