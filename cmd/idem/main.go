// Command idem is the operators' tool of the idempotency library: it answers
// "was this event applied?", shows and redrives dead-lettered messages,
// replays the outbox, reconciles uncertain external operations and previews
// the purge, against the real database and broker.
//
//	idem processed show EVENT_ID [--consumer C]
//	idem dlq list QUEUE [--limit N]
//	idem dlq show QUEUE EVENT_ID [--payload]
//	idem dlq redrive QUEUE (--event-id ID … | --all) [--dry-run] [--to QUEUE]
//	idem outbox replay --from T1 --to T2 [--topic T] [--dry-run]
//	idem operations list [--state uncertain]
//	idem operations resolve KEY (--succeeded REF | --failed REASON) [--by NAME]
//	idem purge --dry-run [--horizon D]
//
// Every command prints a table, or one JSON document with --json. The
// database is DATABASE_URL (or --database-url), the broker AMQP_URL (or
// --amqp-url), with the demo's defaults. Run "idem help" for the flags and
// the exit codes (see exitUsage and the other exit constants).
package main

import "os"

func main() {
	os.Exit(Run(os.Args[1:], os.Stdout, os.Stderr))
}
