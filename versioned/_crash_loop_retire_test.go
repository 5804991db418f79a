package versioned_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// A family message redelivered after MaxCrashes-1 crashes runs its last
// attempt: the filter retires it before the handler (except on SQLite,
// whose only write lock the attempt holds: documented), and on every target
// the attempt runs its handler and succeeds. On SQLite the retirement
// beside the attempt waited out busy_timeout and failed on every
// redelivery, so the message was never applied.
func TestLastAttemptBeforeCrashLoopRetiresAndRunsTheHandler(t *testing.T) {
	t.Parallel()
	for _, drv := range []string{"pgx", "database/sql", testenv.TargetMariaDB, testenv.TargetSQLite} {
		t.Run(drv, func(t *testing.T) {
			t.Parallel()
			e := newLFEnvWith(t, "postgres", drv)
			fam := versioned.Family{Kind: "customer.status", ID: "c-1"}
			m3 := lfSeqMsg(t, fam, 3)
			require.NoError(t, e.publisher(&lfQueue{}).Publish("customer.status", m3))
			idem, err := inbox.NewIdempotent(inbox.Config{
				Beginner: e.beginner, Store: e.processed, Consumer: "crm",
				MaxCrashes: 3, CrashQuerier: e.db,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			ctx := context.Background()
			id := uuid.MustParse(m3.UUID)
			// Two earlier attempts died (their starts were never ended).
			for i := 0; i < 2; i++ {
				_, err := e.processed.StartAttempt(ctx, e.db, "crm", id)
				require.NoError(t, err)
			}
			calls := 0
			h := idem.Middleware(e.filter("crm").Middleware(func(msg *message.Message) ([]*message.Message, error) {
				calls++
				return nil, nil
			}))
			d := m3.Copy()
			d.Metadata.Set(marshaler.MetadataRedelivered, "true")
			c, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			d.SetContext(c)
			_, err = h(d)
			require.NoError(t, err, "the last attempt before a crash loop fails")
			require.Equal(t, 1, calls)
			retired := 1
			if drv == testenv.TargetSQLite {
				retired = 0
			}
			require.Equal(t, retired, e.count(`SELECT count(*) FROM family_applied_retired WHERE consumer = 'crm'`))
		})
	}
}

// Two consumers nested around one handler (allowed: only the same consumer
// nested is refused). The outer consumer ("audit") is at its last attempt
// before a crash loop; the inner one ("stock", with the latest filter) has
// its crash bound off, so its attempt is not counted: the flag must be
// false there and the filter must not retire the message at "stock"
// (docs: "Not retired: ... nor one on a consumer whose crash bound is off").
func TestLastAttemptOfAnOuterConsumerIsNotANestedConsumersLast(t *testing.T) {
	t.Parallel()
	e := newLFEnvWith(t, "postgres", "pgx")
	fam := versioned.Family{Kind: "customer.status", ID: "c-1"}
	m2, m3 := lfSeqMsg(t, fam, 2), lfSeqMsg(t, fam, 3)
	pub := e.publisher(&lfQueue{})
	require.NoError(t, pub.Publish("customer.status", m2))
	require.NoError(t, pub.Publish("customer.status", m3))
	ctx := context.Background()
	audit, err := inbox.NewIdempotent(inbox.Config{
		Beginner: e.beginner, Store: e.processed, Consumer: "audit",
		MaxCrashes: 3, CrashQuerier: e.db,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	stock, err := inbox.NewIdempotent(inbox.Config{ // crash bound off
		Beginner: e.beginner, Store: e.processed, Consumer: "stock",
	}, watermill.NopLogger{})
	require.NoError(t, err)
	id := uuid.MustParse(m3.UUID)
	for i := 0; i < 2; i++ { // two earlier attempts of audit died
		_, err := e.processed.StartAttempt(ctx, e.db, "audit", id)
		require.NoError(t, err)
	}
	var flagSeen []bool
	var applied []string
	fail := true
	h := audit.Middleware(stock.Middleware(e.filter("stock").Middleware(func(msg *message.Message) ([]*message.Message, error) {
		flagSeen = append(flagSeen, inbox.LastAttemptBeforeCrashLoop(msg.Context()))
		if msg.UUID == m3.UUID && fail {
			return nil, inbox.Transient(errNestedTransient)
		}
		applied = append(applied, string(msg.Payload))
		return nil, nil
	})))
	d := m3.Copy()
	d.Metadata.Set(marshaler.MetadataRedelivered, "true")
	d.SetContext(ctx)
	_, err = h(d)
	require.Error(t, err)
	assert.Equal(t, []bool{false}, flagSeen, "LastAttemptBeforeCrashLoop true inside consumer stock, whose crash bound is off")
	assert.Zero(t, e.count(`SELECT count(*) FROM family_applied_retired WHERE consumer = 'stock'`),
		"m3 retired at consumer stock, whose crash bound is off and whose attempt is not its last")
	// Consequence: m2, obsolete behind m3 (which did not crash and will be
	// applied), is let through at stock.
	require.NoError(t, deliver(stock.Middleware(e.filter("stock").Middleware(func(msg *message.Message) ([]*message.Message, error) {
		applied = append(applied, string(msg.Payload))
		return nil, nil
	})), m2))
	assert.Empty(t, applied, "m2 applied at stock although obsolete behind m3")
}

var errNestedTransient = nestedError("a transient failure")

type nestedError string

func (e nestedError) Error() string { return string(e) }
