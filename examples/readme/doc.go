// Package readme holds the README's "Using it" snippet as compiled code:
// example_test.go defines runStock, whose text the README shows between
// the markers, and Example calls it; TestREADMESnippet fails when the two
// differ, so the snippet a user copies is code that compiles against this
// version of the library.
package readme
