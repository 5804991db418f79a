package inbox

import "time"

// SetCountedTurnWait sets the bound of the wait for the process's counted
// attempt slot until the returned function restores it.
func SetCountedTurnWait(d time.Duration) (restore func()) {
	old := countedTurnWait.Swap(int64(d))
	return func() { countedTurnWait.Store(old) }
}

// SessionLockRecheck is how many claims a connection makes under its
// session's lock_timeout before the claim sets it again.
const SessionLockRecheck = sessionLockRecheck
