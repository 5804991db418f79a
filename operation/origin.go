package operation

import "errors"

// ownDBError classifies an error of the Runner's own database calls (taking
// the key's lock, reading and starting its record) by origin: it is the
// attempt's infrastructure, so it is transient for the middleware chain
// (held and retried in place, never poisoned), whatever its shape. Errors
// that already carry a class (Permanent() / Transient() / Configuration()
// methods) or a typed SQLSTATE (SQLState() string: the middleware classifies
// those by code, e.g. 42P01 a missing table is a configuration error) are
// returned as they are.
func ownDBError(err error) error {
	if err == nil {
		return nil
	}
	var p interface{ Permanent() bool }
	var t interface{ Transient() bool }
	var c interface{ Configuration() bool }
	var s interface{ SQLState() string }
	if errors.As(err, &p) || errors.As(err, &t) || errors.As(err, &c) || errors.As(err, &s) {
		return err
	}
	return &transientError{err}
}
