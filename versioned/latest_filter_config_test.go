package versioned_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/versioned"
)

// A LatestFilterConfig.Consumer the family tables cannot hold is refused
// where it is made, naming the field: over 255 bytes (MySQL's VARBINARY(255)
// refused it with 1406), not UTF-8 or with a NUL (PostgreSQL refused it
// with 22021). Accepted, it failed every message of a family, and the
// retirement of the poisoned one too, on one database and not the others.
// A name of 255 bytes works on every target.
func TestLatestFilterConfigRefusesAConsumerTheStoreCannotHold(t *testing.T) {
	t.Parallel()
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) {
		e := newLFEnvWith(t, "postgres", tg.Name)
		for _, name := range []string{strings.Repeat("c", 256), "crm\xff", "crm\x00"} {
			_, err := versioned.NewLatestFilter(versioned.LatestFilterConfig{Families: e.families, Consumer: name}, nil)
			require.ErrorContains(t, err, "LatestFilterConfig.Consumer", "%q", name)
		}

		longest := strings.Repeat("é", versioned.MaxFamilyPartLen/2) + "c"
		f, err := versioned.NewLatestFilter(versioned.LatestFilterConfig{Families: e.families, Consumer: longest}, nil)
		require.NoError(t, err)
		idem, err := inbox.NewIdempotent(inbox.Config{Beginner: e.beginner, Store: e.processed, Consumer: "crm"}, nil)
		require.NoError(t, err)
		calls := 0
		h := idem.Middleware(f.Middleware(func(*message.Message) ([]*message.Message, error) { calls++; return nil, nil }))
		m1 := lfSeqMsg(t, versioned.Family{Kind: "customer.status", ID: "c-1"}, 1)
		require.NoError(t, e.publisher(&lfQueue{}).Publish("customer.status", m1))
		require.NoError(t, deliver(h, m1))
		require.Equal(t, 1, calls)
		require.Equal(t, 1, e.count(`SELECT count(*) FROM family_applied WHERE consumer = $1`, longest))
	})
}
