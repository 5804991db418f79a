package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// table prints rows under a header, columns aligned.
func table(w io.Writer, header []string, rows [][]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	_ = tw.Flush()
}

// fields prints "name: value" lines, names aligned.
func fields(w io.Writer, kv [][2]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	for _, p := range kv {
		fmt.Fprintf(tw, "%s:\t%s\n", p[0], p[1])
	}
	_ = tw.Flush()
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// ts formats a time for tables: UTC, microseconds; "-" for the zero time.
func ts(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000000Z")
}

// jsonTime is a time that marshals as null when zero.
type jsonTime time.Time

func (t jsonTime) MarshalJSON() ([]byte, error) {
	if time.Time(t).IsZero() {
		return []byte("null"), nil
	}
	return json.Marshal(time.Time(t).UTC().Format(time.RFC3339Nano))
}

func (t *jsonTime) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*t = jsonTime{}
		return nil
	}
	var v time.Time
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*t = jsonTime(v)
	return nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// truncate shortens s to n runes for a table cell, on one line.
func truncate(s string, n int) string {
	s = oneLine(s)
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

// timeScan reads a timestamp column of any dialect: time.Time (pgx, MySQL
// with parseTime) or text (SQLite's ISO 8601 UTC).
type timeScan struct{ t time.Time }

func (ts *timeScan) Scan(src any) error {
	var text string
	switch v := src.(type) {
	case nil:
		ts.t = time.Time{}
		return nil
	case time.Time:
		ts.t = v
		return nil
	case string:
		text = v
	case []byte:
		text = string(v)
	default:
		return fmt.Errorf("time: unsupported type %T", src)
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02 15:04:05.999999999", "2006-01-02T15:04:05.999999999"} {
		if t, err := time.Parse(layout, text); err == nil {
			ts.t = t.UTC()
			return nil
		}
	}
	return fmt.Errorf("time: cannot parse %q", text)
}
