package versioned_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/outbox"
	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

// The producer's transaction writes the outbox rows and the latest records
// together: a rollback leaves neither, a commit both; one Publish of several
// updates records the newest; messages without a family are published
// untouched; an invalid family publishes nothing.
func TestLatestPublisherInOutboxTransaction(t *testing.T) {
	t.Parallel()
	e := newLFEnv(t, "postgres")
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: idempotency.Pgx(e.pool)}, nil)
	require.NoError(t, err)
	require.NoError(t, ob.Migrate(ctx))
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	jsonMsg := func(seq int64) *message.Message {
		msg, err := marshaler.NewMessage("product.updated", map[string]int64{"version": seq})
		require.NoError(t, err)
		if seq > 0 {
			require.NoError(t, versioned.SetFamilySeq(msg, f, seq))
		}
		return msg
	}
	publishInTx := func(commit bool, msgs ...*message.Message) error {
		tx, err := e.pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		inner, err := ob.PgxPublisher(tx)
		require.NoError(t, err)
		pub, err := versioned.NewLatestPublisher(inner, versioned.LatestPublisherConfig{Store: e.families, Tx: idempotency.PgxTx(tx)}, nil)
		require.NoError(t, err)
		if err := pub.Publish("products", msgs...); err != nil {
			return err
		}
		if commit {
			return tx.Commit(ctx)
		}
		return tx.Rollback(ctx)
	}
	latest := func() (versioned.Position, bool) {
		p, ok, err := e.families.Latest(ctx, e.db, f)
		require.NoError(t, err)
		return p, ok
	}

	require.NoError(t, publishInTx(false, jsonMsg(5)))
	_, ok := latest()
	require.False(t, ok, "rolled back: no record")
	require.Equal(t, 0, e.count(`SELECT count(*) FROM outbox`))

	m3, m2 := jsonMsg(3), jsonMsg(2)
	require.NoError(t, publishInTx(true, m3, jsonMsg(0), m2))
	p, ok := latest()
	require.True(t, ok)
	require.Equal(t, int64(3), p.Seq, "the newest of the batch")
	require.Equal(t, m3.UUID, p.EventID.String())
	require.Equal(t, 3, e.count(`SELECT count(*) FROM outbox`))

	require.NoError(t, publishInTx(true, jsonMsg(1)))
	p, _ = latest()
	require.Equal(t, int64(3), p.Seq, "never backwards")

	bad := jsonMsg(4)
	bad.Metadata.Set(versioned.MetadataFamilySeq, "four")
	require.ErrorIs(t, publishInTx(true, jsonMsg(9), bad), versioned.ErrFamilyInvalid)
	p, _ = latest()
	require.Equal(t, int64(3), p.Seq)
	require.Equal(t, 4, e.count(`SELECT count(*) FROM outbox`), "nothing of the refused batch")
}

// With Redis the record is written only once the message is out: right
// after a broker publish, or, Deferred, at Flush after the producer's
// commit. A failed publish records nothing; Discard forgets; a Redis failure
// does not fail a publish that is already out.
func TestLatestPublisherRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := lfRedis(t)
	store, err := redislatest.New(redislatest.Config{Client: client, Prefix: prefix})
	require.NoError(t, err)
	f := versioned.Family{Kind: "product.index", ID: "p-1"}
	seqOf := func() int64 {
		p, ok, err := store.Latest(ctx, nil, f)
		require.NoError(t, err)
		if !ok {
			return -1
		}
		return p.Seq
	}

	broker := &lfQueue{}
	direct, err := versioned.NewLatestPublisher(broker, versioned.LatestPublisherConfig{Store: store}, nil)
	require.NoError(t, err)
	broker.fail = errors.New("broker down")
	require.ErrorContains(t, direct.Publish("t", lfSeqMsg(t, f, 1)), "broker down")
	require.Equal(t, int64(-1), seqOf(), "not published, not recorded")
	broker.fail = nil
	require.NoError(t, direct.Publish("t", lfSeqMsg(t, f, 2)))
	require.Equal(t, int64(2), seqOf())

	outboxLike := &lfQueue{}
	deferred, err := versioned.NewLatestPublisher(outboxLike, versioned.LatestPublisherConfig{Store: store, Deferred: true}, nil)
	require.NoError(t, err)
	require.NoError(t, deferred.Publish("t", lfSeqMsg(t, f, 5)))
	require.NoError(t, deferred.Publish("t", lfSeqMsg(t, f, 4)))
	require.Equal(t, int64(2), seqOf(), "held back until the commit")
	require.NoError(t, deferred.Flush(ctx))
	require.Equal(t, int64(5), seqOf())
	require.NoError(t, deferred.Flush(ctx), "nothing left")

	require.NoError(t, deferred.Publish("t", lfSeqMsg(t, f, 9)))
	deferred.Discard() // the transaction rolled back
	require.NoError(t, deferred.Flush(ctx))
	require.Equal(t, int64(5), seqOf())

	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = down.Close() })
	downStore, err := redislatest.New(redislatest.Config{Client: down})
	require.NoError(t, err)
	lost, err := versioned.NewLatestPublisher(broker, versioned.LatestPublisherConfig{Store: downStore}, nil)
	require.NoError(t, err)
	before := broker.len()
	require.NoError(t, lost.Publish("t", lfSeqMsg(t, f, 10)), "the message is out; the record is only lost")
	require.Equal(t, before+1, broker.len())
	lostDeferred, err := versioned.NewLatestPublisher(broker, versioned.LatestPublisherConfig{Store: downStore, Deferred: true}, nil)
	require.NoError(t, err)
	require.NoError(t, lostDeferred.Publish("t", lfSeqMsg(t, f, 11)))
	require.Error(t, lostDeferred.Flush(ctx), "Flush reports it")
}

func TestLatestPublisherConfigValidate(t *testing.T) {
	t.Parallel()
	families, err := versioned.NewFamilyStore(versioned.FamilyStoreConfig{})
	require.NoError(t, err)
	client, _ := lfRedis(t)
	redisStore, err := redislatest.New(redislatest.Config{Client: client})
	require.NoError(t, err)
	q := &lfQueue{}
	for want, cfg := range map[string]versioned.LatestPublisherConfig{
		"LatestPublisherConfig.Store":    {},
		"LatestPublisherConfig.Tx":       {Store: families},
		"LatestPublisherConfig.Deferred": {Store: families, Tx: idempotency.SQLTx(nil), Deferred: true},
	} {
		_, err := versioned.NewLatestPublisher(q, cfg, nil)
		require.ErrorContains(t, err, want)
	}
	_, err = versioned.NewLatestPublisher(nil, versioned.LatestPublisherConfig{Store: redisStore}, nil)
	require.Error(t, err)
	p, err := versioned.NewLatestPublisher(q, versioned.LatestPublisherConfig{Store: redisStore}, nil)
	require.NoError(t, err)
	require.NoError(t, p.Close())
}
