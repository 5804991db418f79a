package analyzer

import "testing"

func TestIsWriteSQL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sql  string
		want bool
	}{
		{"INSERT INTO t VALUES (1)", true},
		{"  update t set a = 1", true},
		{"Delete From t", true},
		{"MERGE INTO t USING s ON true WHEN MATCHED THEN DELETE", true},
		{"(INSERT INTO t VALUES (1))", true},
		{"-- note\nINSERT INTO t VALUES (1)", true},
		{"/* a /* nested */ comment */ DELETE FROM t", true},
		{"WITH x AS (DELETE FROM a RETURNING *) SELECT * FROM x", true},
		{"WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x", true},
		{"SELECT 1; DELETE FROM t", true},
		{"SELECT * FROM t", false},
		{"SELECT * FROM t FOR UPDATE", false},
		{"WITH x AS (SELECT id FROM t FOR UPDATE) SELECT * FROM x", false},
		{"WITH x AS (SELECT id FROM t FOR NO KEY UPDATE) SELECT * FROM x", false},
		{"SELECT 'INSERT INTO t'", false},
		{"SELECT E'it''s \\' DELETE'", false},
		{`SELECT "delete" FROM t`, false},
		{"SELECT $$UPDATE$$, $tag$DELETE$tag$", false},
		{"SELECT $1::text", false},
		{"-- DELETE FROM t\nSELECT 1", false},
		{"", false},
		{"inserted_rows", false},
	} {
		if got := isWriteSQL(tc.sql); got != tc.want {
			t.Errorf("isWriteSQL(%q) = %v, want %v", tc.sql, got, tc.want)
		}
	}
}

func TestEndsTransaction(t *testing.T) {
	t.Parallel()
	own := map[string]bool{"MINE": true}
	for _, tc := range []struct {
		sql  string
		want string // "" when the transaction stays open
	}{
		{"COMMIT", "COMMIT"},
		{"commit work", "COMMIT"},
		{"END", "END"},
		{"ABORT", "ABORT"},
		{"ROLLBACK", "ROLLBACK"},
		{"ROLLBACK AND CHAIN", "ROLLBACK"},
		{"ROLLBACK TO SAVEPOINT x", ""},
		{"ROLLBACK TO x", ""},
		{"ROLLBACK WORK TO SAVEPOINT x", ""},
		{"RELEASE SAVEPOINT theirs", "RELEASE SAVEPOINT"},
		{"RELEASE theirs", "RELEASE SAVEPOINT"},
		{"RELEASE SAVEPOINT mine", ""},
		{"release mine", ""},
		{"PREPARE TRANSACTION 'gid'", "PREPARE TRANSACTION"},
		{"PREPARE stmt AS SELECT 1", ""},
		{"UPDATE t SET a = 1; COMMIT;", "COMMIT"},
		{"SELECT 'COMMIT'", ""},
		{"COMMENT ON TABLE t IS 'x'", ""},
		{"SAVEPOINT x", ""},
	} {
		got, ends := endsTransaction(tc.sql, own)
		if ends != (tc.want != "") || got != tc.want {
			t.Errorf("endsTransaction(%q) = %q, %v; want %q", tc.sql, got, ends, tc.want)
		}
	}
}

func TestSavepointNames(t *testing.T) {
	t.Parallel()
	got := savepointNames("SAVEPOINT a; UPDATE t SET x = 1; savepoint b")
	if len(got) != 2 || got[0] != "A" || got[1] != "B" {
		t.Fatalf("savepointNames = %q, want [A B]", got)
	}
}
