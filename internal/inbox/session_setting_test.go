package inbox

import (
	"strings"
	"testing"
)

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

func TestStatementsSeenPlainDoNotHideALaterSessionChange(t *testing.T) {
	st := &connClaim{lockMs: 60}
	insert := "INSERT INTO reservation (event_id) VALUES ($1)"
	for i := 0; i < 10; i++ {
		st.handlerStatement(insert)
		st.handlerStatement("UPDATE stock SET reserved = reserved + 1")
	}
	if st.lockMs != 60 {
		t.Fatalf("plain statements forgot the session's lock timeout: lockMs = %d", st.lockMs)
	}
	// The same length as a remembered statement, other bytes.
	set := []byte(insert)
	copy(set, "SET lock_timeout = 0;")
	st.handlerStatement(string(set))
	if st.lockMs != 0 {
		t.Fatalf("a statement naming lock_timeout after remembered plain ones was not seen")
	}
	// Remembered statements are never scanned again, but a changed session
	// is still found after more of them than the memory holds.
	st.lockMs = 60
	for i := 0; i < 2*len(st.plain); i++ {
		st.handlerStatement(strings.Repeat(" ", i+1) + insert)
	}
	st.handlerStatement(insert + "; RESET ALL")
	if st.lockMs != 0 {
		t.Fatalf("RESET ALL after a full memory of plain statements was not seen")
	}
}
