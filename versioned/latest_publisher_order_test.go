package versioned_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// One Publish call advances its families in (kind, id) order, whatever the
// order of its messages, so two producers publishing the same families in
// one call each lock their latest rows in one order and cannot deadlock.
// Seen from the locks: while another transaction holds family a's row, a
// producer publishing p, o, …, b, a in one call waits at a without having
// locked any other.
func TestLatestPublisherAdvancesFamiliesInKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tg := testenv.NewTarget(t, testenv.TargetPostgresPgx, 4)
	s := migratedFamiliesOn(t, tg)
	// Families a to p; the producer's messages come in reverse order.
	var fams []versioned.Family
	for c := 'a'; c <= 'p'; c++ {
		fams = append(fams, versioned.Family{Kind: "product", ID: string(c)})
	}
	for _, f := range fams {
		_, err := s.Advance(ctx, tg.DB, f, versioned.SeqPosition(1, uuid.Must(uuid.NewV7())))
		require.NoError(t, err)
	}
	locked := `SELECT 1 FROM family_latest WHERE family_kind = $1 AND family_id = $2 FOR UPDATE`

	holder, err := tg.Pgx.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, locked, fams[0].Kind, fams[0].ID)
	require.NoError(t, err)

	producer, err := tg.Pgx.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = producer.Rollback(ctx) }()
	var pid int
	require.NoError(t, producer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	pub, err := versioned.NewLatestPublisher(&lfQueue{}, versioned.LatestPublisherConfig{Store: s, Tx: idempotency.PgxTx(producer)}, nil)
	require.NoError(t, err)
	var msgs []*message.Message
	for i := len(fams) - 1; i >= 0; i-- {
		msgs = append(msgs, lfSeqMsg(t, fams[i], 2))
	}
	published := make(chan error, 1)
	go func() { published <- pub.Publish("product", msgs...) }()
	testenv.Eventually(t, 10*time.Second, "the producer to wait for family a's row", func(o *testenv.Observed) bool {
		var waiting bool
		err := tg.DB.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting)
		return o.Err("pg_stat_activity", err) && o.Bool("waiting", waiting)
	})

	for _, f := range fams[1:] {
		other, err := tg.Pgx.Begin(ctx)
		require.NoError(t, err)
		_, err = other.Exec(ctx, locked+` NOWAIT`, f.Kind, f.ID)
		require.NoError(t, other.Rollback(ctx))
		require.NoError(t, err, "family %s's row is free: the producer waits at a, the first in key order", f.ID)
	}

	require.NoError(t, holder.Rollback(ctx))
	require.NoError(t, <-published)
	require.NoError(t, producer.Commit(ctx))
	for _, f := range fams {
		pos, ok, err := s.Latest(ctx, tg.DB, f)
		require.NoError(t, err)
		require.True(t, ok)
		require.EqualValues(t, 2, pos.Seq)
	}
}
