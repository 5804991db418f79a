// Package watermill is a stub of github.com/ThreeDotsLabs/watermill for the
// analyzer's tests.
package watermill

func NewUUID() string      { return "" }
func NewShortUUID() string { return "" }
func NewULID() string      { return "" }
