package main

import "context"

func runOutboxReplay(ctx context.Context, e *env, args []string) error {
	return usageErr("not yet")
}
