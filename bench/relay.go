package bench

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
)

// RelaySizes sizes the relay part (issue 12's measurement).
type RelaySizes struct {
	// Hold is how long each latency phase lasts; in the second phase a
	// session in another database of the server holds a write transaction
	// open that long.
	Hold time.Duration
	// Every is the interval between two messages of a latency phase.
	Every time.Duration
	// Rows are the messages written (and relayed) for the table-at-rest
	// measurement.
	Rows int
}

// relaySizes returns the relay part's sizes for a profile (kept here, not
// in Sizes, so this part stays in its own file).
func relaySizes(profile string) RelaySizes {
	switch profile {
	case Full.Name:
		return RelaySizes{Hold: 60 * time.Second, Every: 20 * time.Millisecond, Rows: 100_000}
	case Quick.Name:
		return RelaySizes{Hold: 5 * time.Second, Every: 20 * time.Millisecond, Rows: 10_000}
	default:
		return RelaySizes{Hold: 300 * time.Millisecond, Every: 20 * time.Millisecond, Rows: 300}
	}
}

// arrivals is the relay's destination: an in-process publisher that
// timestamps the first arrival of each message.
type arrivals struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (a *arrivals) Publish(_ string, msgs ...*message.Message) error {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, m := range msgs {
		if _, ok := a.at[m.UUID]; !ok {
			a.at[m.UUID] = now
		}
	}
	return nil
}

func (a *arrivals) Close() error { return nil }

func (a *arrivals) arrived(id string) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, ok := a.at[id]
	return t, ok
}

// relay measures the outbox relay (issue 12) on PostgreSQL: delivery
// latency (producer's commit → the relay's publish to an in-process
// destination) with the server idle and while another session holds a
// write transaction open in another database (BEGIN; SELECT
// pg_current_xact_id() in database "postgres"), one phase after the other
// in one run; then Rows messages written while the relay runs, and the
// outbox table's rows once they are relayed.
func relay(ctx context.Context, e *env, sz RelaySizes, res *Result) error {
	schema, err := e.schema(ctx, "relay")
	if err != nil {
		return err
	}
	pool, err := e.pool(ctx, schema, 4)
	if err != nil {
		return err
	}
	defer e.closePool(pool)
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "bench_outbox"}, nil)
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}
	dest := &arrivals{at: map[string]time.Time{}}
	r, err := ob.NewRelay(dest, outbox.RelayConfig{})
	if err != nil {
		return err
	}
	runDone := make(chan error, 1)
	go func() { runDone <- r.Run(ctx) }()
	defer func() { _ = r.Close(); <-runDone }()
	<-r.Running()

	write := func(ids ...string) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			pub, err := ob.PgxPublisher(tx)
			if err != nil {
				return err
			}
			msgs := make([]*message.Message, len(ids))
			for i, id := range ids {
				m := message.NewMessage(id, []byte(`{"bench":true}`))
				m.Metadata.Set(marshaler.MetadataEventName, "bench.relay")
				m.Metadata.Set(marshaler.MetadataOccurredAt, time.Now().UTC().Format(time.RFC3339Nano))
				msgs[i] = m
			}
			return pub.Publish("events", msgs...)
		})
	}
	phase := func() ([]time.Duration, error) {
		type sentAt struct {
			id string
			at time.Time
		}
		var sent []sentAt
		tick := time.NewTicker(sz.Every)
		defer tick.Stop()
		for start := time.Now(); time.Since(start) < sz.Hold; {
			id := uuid.Must(uuid.NewV7()).String()
			if err := write(id); err != nil {
				return nil, err
			}
			sent = append(sent, sentAt{id, time.Now()})
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-tick.C:
			}
		}
		deadline := time.Now().Add(sz.Hold + 30*time.Second)
		out := make([]time.Duration, 0, len(sent))
		for _, s := range sent {
			for {
				if at, ok := dest.arrived(s.id); ok {
					out = append(out, max(at.Sub(s.at), 0))
					break
				}
				if time.Now().After(deadline) {
					return nil, fmt.Errorf("relay: %s not delivered %s after the phase", s.id, sz.Hold+30*time.Second)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}
		return out, nil
	}

	fmt.Fprintf(e.log, "relay: latency, idle, %s\n", sz.Hold)
	idle, err := phase()
	if err != nil {
		return err
	}
	fmt.Fprintf(e.log, "relay: latency, write transaction open in database postgres, %s\n", sz.Hold)
	release, err := holdWriteTx(ctx, e.pgURL)
	if err != nil {
		return err
	}
	open, err := phase()
	release()
	if err != nil {
		return err
	}

	fmt.Fprintf(e.log, "relay: %d messages written while the relay runs\n", sz.Rows)
	start := time.Now()
	const perTx = 100
	for done := 0; done < sz.Rows; done += perTx {
		ids := make([]string, min(perTx, sz.Rows-done))
		for i := range ids {
			ids[i] = uuid.Must(uuid.NewV7()).String()
		}
		if err := write(ids...); err != nil {
			return err
		}
	}
	wrote := time.Since(start)
	var pending int
	for {
		if pending, err = ob.Pending(ctx); err != nil {
			return err
		}
		if pending == 0 {
			break
		}
		if time.Since(start) > 10*time.Minute {
			return fmt.Errorf("relay: %d rows still pending after 10 min", pending)
		}
		time.Sleep(10 * time.Millisecond)
	}
	drained := time.Since(start)
	var rows, archived, dead int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM bench_outbox), (SELECT count(*) FROM bench_outbox_relayed), (SELECT count(*) FROM bench_outbox_dead)`).Scan(&rows, &archived, &dead); err != nil {
		return err
	}

	p50i, p99i := percentile(idle, 0.50), percentile(idle, 0.99)
	p50o, p99o := percentile(open, 0.50), percentile(open, 0.99)
	res.set("relay_idle_p50_ms", ms(p50i))
	res.set("relay_idle_p99_ms", ms(p99i))
	res.set("relay_open_tx_p50_ms", ms(p50o))
	res.set("relay_open_tx_p99_ms", ms(p99o))
	res.set("relay_open_tx_p99_ratio", ratio(ms(p99o), ms(p99i)))
	res.set("relay_rows_after", float64(rows))
	res.set("relay_msgs_per_s", float64(sz.Rows)/drained.Seconds())
	res.Tables = append(res.Tables, Table{
		Title:  "6. outbox relay (issue 12)",
		Header: []string{"phase", "messages", "p50 ms", "p99 ms", "max ms"},
		Rows: [][]string{
			{"idle", fmt.Sprint(len(idle)), f1(ms(p50i)), f1(ms(p99i)), f1(ms(maxDur(idle)))},
			{"write tx open in another database", fmt.Sprint(len(open)), f1(ms(p50o)), f1(ms(p99o)), f1(ms(maxDur(open)))},
		},
		Notes: []string{
			fmt.Sprintf("latency: producer commit → relay publish to an in-process destination; one message every %s per phase of %s; default RelayConfig (PollInterval %s)", sz.Every, sz.Hold, outbox.DefaultPollInterval),
			fmt.Sprintf("table at rest: %d messages written (%d per transaction) in %s while the relay ran, all relayed after %s (%.0f msg/s); outbox rows after: %d (archive %d, dead letters %d)",
				sz.Rows, perTx, wrote.Round(time.Millisecond), drained.Round(time.Millisecond), float64(sz.Rows)/drained.Seconds(), rows, archived, dead),
		},
	})
	return nil
}

// holdWriteTx opens a session in database "postgres" of the server at
// pgURL with a write transaction (a transaction id assigned) and returns
// its rollback.
func holdWriteTx(ctx context.Context, pgURL string) (func(), error) {
	u, err := url.Parse(pgURL)
	if err != nil {
		return nil, err
	}
	u.Path = "/postgres"
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		return nil, fmt.Errorf("relay: connect to database postgres: %w", err)
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`)
	}
	if err != nil {
		_ = conn.Close(ctx)
		return nil, fmt.Errorf("relay: open write transaction: %w", err)
	}
	return func() {
		_ = tx.Rollback(context.Background())
		_ = conn.Close(context.Background())
	}, nil
}
