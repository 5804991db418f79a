package inbox

import "testing"

// A handler statement that may change the session's lock_timeout makes the
// next claim on that connection set it again; the check folds case and
// finds the words anywhere in the text (also inside a set_config call).
func TestHandlerStatementsThatMayChangeTheSessionLockTimeoutAreRecognised(t *testing.T) {
	for sql, want := range map[string]bool{
		"SET SESSION lock_timeout = '7s'":               true,
		"set lock_timeout to 0":                         true,
		"SELECT set_config('Lock_Timeout', '0', false)": true,
		"RESET ALL":          true,
		"reset lock_timeout": true,
		"INSERT INTO reservation (event_id) VALUES ($1)": false,
		"UPDATE stock SET reserved = reserved + 1":       false,
		"SELECT 'lock_timeou'":                           false,
		"":                                               false,
		"l":                                              false,
		"SET LOCAL statement_timeout = '1s'; select 'rese'": false,
	} {
		if got := mentionsSessionSetting(sql); got != want {
			t.Errorf("mentionsSessionSetting(%q) = %v, want %v", sql, got, want)
		}
	}
}
