package inbox_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// A poisoned envelope with thousands of short headers (3,000 of 25 bytes:
// 75 KB, over the 64 KiB budget of copied headers) is copied to the poison
// topic with the keys the adapters' encoders need: its event name and its
// time, which are no longer than the others. The budget left out the
// largest values first, the envelope's 30-byte occurred_at among them; the
// copy was no envelope, the marshaler refused it on every publish
// ("metadata event_name: missing"), and the delivery was held and
// redelivered for ever.
func TestPoisonCopyOfAnEnvelopeWithManyShortHeadersKeepsItsEnvelopeKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	poison := &capture{msgs: make(chan *message.Message, 1)}
	idem, err := inbox.NewIdempotent(inbox.Config{Beginner: mustBeginner(inbox.NewPgxBeginner(e.pool, inbox.PgxBeginnerConfig{})),
		Store: e.store, Consumer: "stock"}, nil)
	require.NoError(t, err)
	h := chainedHold(t, idem, poison, watermill.NopLogger{}, time.Second, func(*message.Message) ([]*message.Message, error) {
		return nil, inbox.Permanent(errors.New("an array, not an order"))
	})
	msg := newMsg(uuid.Must(uuid.NewV7()).String())
	at := time.Now().UTC().Format(time.RFC3339Nano)
	msg.Metadata.Set(marshaler.MetadataOccurredAt, at)
	for i := 0; i < 3000; i++ {
		msg.Metadata.Set(fmt.Sprintf("%05d", i), "aaaaaaaaaaaaaaaaaaaa")
	}
	_, err = h(msg)
	require.NoError(t, err, "dead-lettered and acked")
	require.Len(t, poison.msgs, 1)
	pm := <-poison.msgs
	require.Equal(t, "order.placed", pm.Metadata.Get(marshaler.MetadataEventName))
	require.Equal(t, at, pm.Metadata.Get(marshaler.MetadataOccurredAt))
	require.NotEmpty(t, pm.Metadata.Get(inbox.MetadataDroppedHeaders), "the headers left out are named")
	_, _, err = marshaler.EncodeMessage(pm, 0)
	require.NoError(t, err, "the copy is an envelope an adapter can publish")
}
