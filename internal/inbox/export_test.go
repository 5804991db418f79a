package inbox

import "time"

// SetCountedTurnWait sets the bound of the wait for the process's counted
// attempt slot until the returned function restores it.
func SetCountedTurnWait(d time.Duration) (restore func()) {
	old := countedTurnWait.Swap(int64(d))
	return func() { countedTurnWait.Store(old) }
}
