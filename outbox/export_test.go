package outbox

import "time"

// SetProcessClock replaces the process clock o reads (time.Now): a relay or
// producer process whose clock is skewed.
func SetProcessClock(o *Outbox, now func() time.Time) { o.now = now }
