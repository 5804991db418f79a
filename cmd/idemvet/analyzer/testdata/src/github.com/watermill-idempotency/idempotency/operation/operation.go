// Package operation is a stub of
// github.com/watermill-idempotency/idempotency/operation.
package operation

import "context"

type Key struct{ s string }

func MustKey(kind, entity string) Key { return Key{kind + ":" + entity} }

type Result struct{ Reference string }

type CallFunc func(ctx context.Context, key string) (Result, error)

type Runner struct{}

func (r *Runner) Do(ctx context.Context, key Key, params any, call CallFunc) (Result, error) {
	return Result{}, nil
}

func (r *Runner) Run(ctx context.Context, key Key, params any, call CallFunc) (Result, error) {
	return Result{}, nil
}
