package versioned_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// The newest message of a family is poisoned at the consumer: the family is
// not frozen behind it. An older message that arrives afterwards, newer than
// what was applied, is applied (today's filter dropped it as obsolete,
// because the latest record still named the poisoned message); a newer
// message published later is filtered as before. For both latest stores
// (the SQL family store, Redis), on every target; by default (the chain
// runs the filter's retirement, middleware.OnPoison, on the middleware's
// own database) and with RetireOnPoison wired explicitly. With
// DisableRetireOnPoison the family freezes (the control case).
func TestLatestFilterPoisonedLatestDoesNotFreezeFamily(t *testing.T) {
	t.Parallel()
	for _, store := range lfStores {
		for _, drv := range testenv.TargetNames {
			for _, wiring := range []string{"default", "explicit", "opt-out"} {
				t.Run(store+"/"+drv+"/"+wiring, func(t *testing.T) {
					t.Parallel()
					e := newLFEnvWith(t, store, drv)
					fam := versioned.Family{Kind: "customer.status", ID: "c-1"}
					m1, m2, m3 := lfSeqMsg(t, fam, 1), lfSeqMsg(t, fam, 2), lfSeqMsg(t, fam, 3)
					pub := e.publisher(&lfQueue{})

					var mu sync.Mutex
					var calls []string
					handler := e.stateHandler(func(msg *message.Message) {
						mu.Lock()
						defer mu.Unlock()
						calls = append(calls, string(msg.Payload))
					})
					failing := func(msg *message.Message) ([]*message.Message, error) {
						if msg.UUID == m3.UUID {
							return nil, inbox.Permanent(errors.New("the handler cannot apply v3"))
						}
						return handler(msg)
					}
					filter := e.filter("crm")
					var err error
					var after []message.HandlerMiddleware
					switch wiring {
					case "explicit":
						after = append(after, filter.RetireOnPoison(e.tg.Handle()))
					case "opt-out":
						filter, err = versioned.NewRecordedLatestFilter(versioned.LatestFilterConfig{
							Families: e.families, Latest: e.latest, Consumer: "crm", DisableRetireOnPoison: true,
						}, e.counter, nil)
						require.NoError(t, err)
					}
					idem, err := inbox.NewIdempotent(inbox.Config{
						Beginner: e.beginner, Store: e.processed, Consumer: "crm", Recorder: e.outcomes,
					}, watermill.NopLogger{})
					require.NoError(t, err)
					poison := &lfQueue{}
					chain, err := inbox.NewChain(inbox.ChainConfig{
						Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "crm.poison",
						AfterPoison: after,
						MaxRetries:  1, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
					}, nil)
					require.NoError(t, err)
					var h message.HandlerFunc = filter.Middleware(failing)
					for i := len(chain) - 1; i >= 0; i-- {
						h = chain[i](h)
					}

					require.NoError(t, pub.Publish("customer.status", m1))
					require.NoError(t, deliver(h, m1))
					// m2 then m3 are published; m3 overtakes m2 and is poisoned.
					require.NoError(t, pub.Publish("customer.status", m2))
					require.NoError(t, pub.Publish("customer.status", m3))
					require.NoError(t, deliver(h, m3), "poisoned and acked")
					require.Equal(t, 1, poison.len())
					if wiring == "opt-out" {
						// The family is frozen: m2 is dropped as obsolete
						// behind the poisoned m3.
						require.NoError(t, deliver(h, m2))
						require.Equal(t, []string{"v1"}, calls)
						require.Zero(t, e.count(`SELECT count(*) FROM family_applied_retired WHERE consumer = 'crm'`))
						return
					}
					// m2 arrives after m3 was poisoned: newer than v1, applied.
					require.NoError(t, deliver(h, m2))
					require.Equal(t, []string{"v1", "v2"}, calls)
					value, _ := e.state("c-1")
					require.Equal(t, "v2", value)
					require.Equal(t, 1, e.count(`SELECT count(*) FROM family_applied_retired WHERE consumer = 'crm'`))

					// Redeliveries stay single: m2 and m1 are duplicates.
					require.NoError(t, deliver(h, m2))
					require.NoError(t, deliver(h, m1))
					require.Len(t, calls, 2)

					// A newer message moves the latest record past the retired
					// one; filtering is as before: an older one that comes
					// later (a late copy of m1 under a new id) is dropped.
					m4 := lfSeqMsg(t, fam, 4)
					late := lfSeqMsg(t, fam, 1)
					require.NoError(t, pub.Publish("customer.status", m4))
					require.NoError(t, pub.Publish("customer.status", late))
					obsoleteBefore := e.counter.Count(versioned.FilterObsolete)
					require.NoError(t, deliver(h, late))
					require.Equal(t, obsoleteBefore+1, e.counter.Count(versioned.FilterObsolete))
					require.NoError(t, deliver(h, m4))
					require.Equal(t, []string{"v1", "v2", "v4"}, calls)

					// Another consumer of the same family, where m3 was not
					// poisoned, still drops m2 as obsolete: retirement is per
					// consumer.
					var other []string
					h2 := e.chain("crm-other", e.stateHandler(func(msg *message.Message) { other = append(other, string(msg.Payload)) }))
					require.NoError(t, deliver(h2, m2))
					require.Empty(t, other)
				})
			}
		}
	}
}

// A poisoned family message whose retirement cannot be written (here its
// RetireDB has no retired table) is not poisoned: the delivery is held and
// its attempt re-run, so that the family cannot freeze behind a message
// dead-lettered without its retirement. It is given back, not acked, when
// its context ends.
func TestLatestFilterRetirementFailureHoldsInsteadOfPoisoning(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		e := newLFEnvWith(t, "postgres", tg.Name)
		fam := versioned.Family{Kind: "customer.status", ID: "c-1"}
		m1 := lfSeqMsg(t, fam, 1)
		require.NoError(t, e.publisher(&lfQueue{}).Publish("customer.status", m1))

		elsewhere := testenv.NewTarget(t, tg.Name, 2) // no family tables there
		filter, err := versioned.NewRecordedLatestFilter(versioned.LatestFilterConfig{
			Families: e.families, Latest: e.latest, Consumer: "crm", RetireDB: elsewhere.Handle(),
		}, e.counter, nil)
		require.NoError(t, err)
		idem, err := inbox.NewIdempotent(inbox.Config{Beginner: e.beginner, Store: e.processed, Consumer: "crm"}, watermill.NopLogger{})
		require.NoError(t, err)
		poison := &lfQueue{}
		chain, err := inbox.NewChain(inbox.ChainConfig{
			Idempotent: idem, PoisonPublisher: poison, PoisonTopic: "crm.poison",
			MaxRetries: 1, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond,
		}, nil)
		require.NoError(t, err)

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		calls := 0
		var h message.HandlerFunc = filter.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls++
			if calls == 3 {
				cancel() // held and re-run: enough; the delivery's context ends
			}
			return nil, inbox.Permanent(errors.New("the handler cannot apply v1"))
		})
		for i := len(chain) - 1; i >= 0; i-- {
			h = chain[i](h)
		}
		d := m1.Copy()
		d.SetContext(ctx)
		_, err = h(d)
		require.Error(t, err, "given back to the broker, not acked")
		require.Equal(t, 3, calls, "held and re-run after the retirement failed")
		require.Zero(t, poison.len(), "never poisoned without its retirement")
	})
}
