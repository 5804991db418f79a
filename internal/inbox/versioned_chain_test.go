package inbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// TestStateCopiesOutOfOrderThroughTheChain (C12) — state copies and out-of-order versions, through the recommended
// chain: stale events are recorded as processed and acked (not retried, not
// poisoned); a missing or null version is permanent (poisoned once); a
// stored NULL version is older than any.
func TestStateCopiesOutOfOrderThroughTheChain(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE customer_copy (customer_id text PRIMARY KEY, version bigint, name text);
		INSERT INTO customer_copy VALUES ('c-2', NULL, 'Legacy')`)
	require.NoError(t, err)
	upsert, err := versioned.NewUpsert(versioned.UpsertConfig{
		Table: "customer_copy", KeyColumns: []string{"customer_id"}, VersionColumn: "version", ValueColumns: []string{"name"},
	})
	require.NoError(t, err)
	rec := &recorder{}
	idem, err := inbox.NewIdempotent(inbox.Config{
		Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store:    e.store, Consumer: "crm-copy", Recorder: rec,
	}, nil)
	require.NoError(t, err)
	poison := &capture{msgs: make(chan *message.Message, 10)}
	chain, err := inbox.NewChain(inbox.ChainConfig{
		Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "crm.dlq",
		MaxRetries: 3, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
	}, nil)
	require.NoError(t, err)
	var outcomes []versioned.Outcome
	calls := 0
	var h message.HandlerFunc = func(msg *message.Message) ([]*message.Message, error) {
		calls++
		var p struct {
			CustomerID string `json:"customer_id"`
			Version    *int64 `json:"version"`
			Name       string `json:"name"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, inbox.Permanent(err)
		}
		q, _ := inbox.QuerierFromContext(msg.Context())
		o, err := upsert.Apply(msg.Context(), testenv.AsTx(q), []any{p.CustomerID}, p.Version, []any{p.Name})
		if err != nil {
			return nil, err
		}
		outcomes = append(outcomes, o)
		if o == versioned.Stale {
			inbox.MarkStale(msg.Context())
		}
		return nil, nil
	}
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	deliver := func(payload string) string {
		id := uuid.Must(uuid.NewV7()).String()
		m := newMsg(id)
		m.Payload = []byte(payload)
		_, err := h(m)
		require.NoError(t, err)
		return id
	}
	var c1 []string
	for _, p := range []string{
		`{"customer_id":"c-1","version":3,"name":"Carol"}`,
		`{"customer_id":"c-1","version":1,"name":"Alice"}`,
		`{"customer_id":"c-1","version":2,"name":"Bea"}`,
		`{"customer_id":"c-1","version":3,"name":"Zed"}`,
	} {
		c1 = append(c1, deliver(p))
	}
	require.Equal(t, []versioned.Outcome{versioned.Inserted, versioned.Stale, versioned.Stale, versioned.Stale}, outcomes)
	var version *int64
	var name string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT version, name FROM customer_copy WHERE customer_id = 'c-1'`).Scan(&version, &name))
	require.EqualValues(t, 3, *version)
	require.Equal(t, "Carol", name)
	for _, id := range c1 {
		require.Equal(t, 1, e.processed(id), "stale events are recorded as processed")
	}
	require.Equal(t, 4, calls, "none retried")
	require.Equal(t, 3, rec.Count(inbox.OutcomeStale))

	deliver(`{"customer_id":"c-2","version":1,"name":"New"}`)
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT version, name FROM customer_copy WHERE customer_id = 'c-2'`).Scan(&version, &name))
	require.EqualValues(t, 1, *version)
	require.Equal(t, "New", name)
	require.Empty(t, poison.msgs, "DLQ 0 so far")

	missing := deliver(`{"customer_id":"c-3","name":"NoVersion"}`)
	null := deliver(`{"customer_id":"c-3","version":null,"name":"NullVersion"}`)
	require.Len(t, poison.msgs, 2, "both c-3 events are poisoned once")
	require.Equal(t, 7, calls, "permanent errors are not retried")
	require.Equal(t, 0, e.count(`SELECT count(*) FROM customer_copy WHERE customer_id = 'c-3'`))
	require.Equal(t, 0, e.processed(missing))
	require.Equal(t, 0, e.processed(null))
}
