package jetstream

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// TestPublisherStoresEveryMessageWithinDuplicateWindow: a republish of an
// event to its own subject (a relay's retry, a redrive) and two dead
// letters of one event, all within the duplicate window, are stored; a
// producer publishing with Marshaler's Nats-Msg-Id ("<event id>:<subject>")
// has its republish dropped (nats-server#2921).
func TestPublisherStoresEveryMessageWithinDuplicateWindow(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, js := testStream(t, url)
	msgs := func() uint64 {
		si, err := js.StreamInfo(stream)
		require.NoError(t, err)
		return si.State.Msgs
	}
	event := newEvent(t)
	publish(t, url, stream, event)
	publish(t, url, stream, event) // Marshaler's Nats-Msg-Id: dropped by the window
	require.Equal(t, uint64(1), msgs())

	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.NoError(t, p.Publish(stream, event), "republish")
	require.Equal(t, uint64(2), msgs())
	dlq := stream + ".dlq"
	require.NoError(t, p.Publish(dlq, event, event), "two dead letters of one event")
	require.Equal(t, uint64(4), msgs())

	bad := marshaler.NewMalformed([]byte("not json"), "m-1", "test")
	require.NoError(t, p.Publish(dlq, bad, bad))
	require.Equal(t, uint64(6), msgs())

	// The messages still carry the event's id for the consumer's claim.
	sub, err := js.SubscribeSync(stream, nats.OrderedConsumer(), nats.DeliverLast())
	require.NoError(t, err)
	nm, err := sub.NextMsg(5e9)
	require.NoError(t, err)
	got, _ := Marshaler{}.Unmarshal(nm)
	require.Equal(t, event.UUID, got.UUID)
	require.NotEqual(t, msgID(event.UUID, stream), nm.Header.Get(nats.MsgIdHdr))
	require.NoError(t, sub.Unsubscribe())
}

func TestPublisherReportsDuplicatePubAck(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	stream, _ := testStream(t, url)
	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	p.newID = func() string { return "same-id" }
	event := newEvent(t)
	require.NoError(t, p.Publish(stream, event))
	err = p.Publish(stream, event)
	require.ErrorIs(t, err, ErrDuplicate)
	require.ErrorContains(t, err, "same-id")
}

// refusal reports the BackPressure and Unroutable methods err answers
// true through errors.As (as outbox.Relay reads them).
func refusal(err error) (backPressure, unroutable bool) {
	var bp interface{ BackPressure() bool }
	var u interface{ Unroutable() bool }
	return errors.As(err, &bp) && bp.BackPressure(), errors.As(err, &u) && u.Unroutable()
}

// newStream adds a stream on the subjects "<name>.>" with cfg's limits and
// deletes it when the test ends.
func newStream(t *testing.T, js nats.JetStreamContext, cfg nats.StreamConfig) string {
	t.Helper()
	name := testStreamName()
	cfg.Name, cfg.Subjects = name, []string{name + ".>"}
	_, err := js.AddStream(&cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(name) })
	return name
}

// TestPublisherFullStreamIsBackPressure: a stream at its limits with
// DiscardNew refuses the publish with API error 10077, for each limit, of
// a message that would fit it once it has room; the error is
// back-pressure, still reaches the *nats.APIError and names the subject
// and the message id.
func TestPublisherFullStreamIsBackPressure(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	_, js := testStream(t, url)
	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	for limit, cfg := range map[string]nats.StreamConfig{
		"messages":             {MaxMsgs: 1, Discard: nats.DiscardNew},
		"bytes":                {MaxBytes: 2048, Discard: nats.DiscardNew},
		"messages per subject": {MaxMsgsPerSubject: 1, Discard: nats.DiscardNew, DiscardNewPerSubject: true},
	} {
		t.Run(limit, func(t *testing.T) {
			stream := newStream(t, js, cfg)
			subject := stream + ".orders"
			if limit == "bytes" { // 1800 bytes stored: no event fits beside them
				_, err := js.Publish(stream+".filler", make([]byte, 1800))
				require.NoError(t, err)
			} else {
				require.NoError(t, p.Publish(subject, newEvent(t)))
			}
			event := newEvent(t)
			err := p.Publish(subject, event)
			require.Error(t, err)
			bp, unroutable := refusal(err)
			require.True(t, bp, "back-pressure: %v", err)
			require.False(t, unroutable)
			var api *nats.APIError
			require.ErrorAs(t, err, &api)
			require.Equal(t, codeStoreFailed, api.ErrorCode)
			require.ErrorContains(t, err, subject)
			require.ErrorContains(t, err, event.UUID)
		})
	}
}

// TestPublisherSubjectWithoutStreamIsUnroutable: no stream takes the
// subject; the error is unroutable and still nats.ErrNoStreamResponse.
func TestPublisherSubjectWithoutStreamIsUnroutable(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	subject := testStreamName() + ".orders" // no stream has it
	for name, ctx := range map[string]context.Context{
		"without a deadline": context.Background(),
		"with a deadline": func() context.Context {
			c, cancel := context.WithTimeout(context.Background(), time.Minute)
			t.Cleanup(cancel)
			return c
		}(),
	} {
		t.Run(name, func(t *testing.T) {
			event := newEvent(t)
			event.SetContext(ctx)
			err := p.Publish(subject, event)
			bp, unroutable := refusal(err)
			require.True(t, unroutable, "unroutable: %v", err)
			require.False(t, bp)
			require.ErrorIs(t, err, nats.ErrNoStreamResponse)
			require.ErrorContains(t, err, subject)
		})
	}
}

// TestPublisherMessageLargerThanStreamMaxIsTheMessagesFault: a message
// over the stream's MaxMsgSize (API error 10054) is neither back-pressure
// nor unroutable: every attempt meets it again.
func TestPublisherMessageLargerThanStreamMaxIsTheMessagesFault(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	_, js := testStream(t, url)
	stream := newStream(t, js, nats.StreamConfig{MaxMsgSize: 16})
	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	err = p.Publish(stream+".orders", newEvent(t))
	require.Error(t, err)
	bp, unroutable := refusal(err)
	require.False(t, bp, "%v", err)
	require.False(t, unroutable, "%v", err)
	var api *nats.APIError
	require.ErrorAs(t, err, &api)
	require.Equal(t, nats.ErrorCode(10054), api.ErrorCode)
}

// TestPublisherMessageThatCanNeverFitTheStreamIsTheMessagesFault: a
// stream with DiscardNew refuses a message whose headers and data alone
// reach its MaxBytes (API error 10077, "maximum bytes exceeded", as for a
// full stream), also when it holds nothing: no room made ever lets it in,
// so the error is not back-pressure (the relay counts it against the row)
// and it says why, naming the stream and its limit.
func TestPublisherMessageThatCanNeverFitTheStreamIsTheMessagesFault(t *testing.T) {
	t.Parallel()
	url := natsURL(t)
	_, js := testStream(t, url)
	stream := newStream(t, js, nats.StreamConfig{MaxBytes: 1024, Discard: nats.DiscardNew})
	p, err := NewPublisher(PublisherConfig{URL: url})
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	big, err := marshaler.NewMessage("order.placed", map[string]string{"note": strings.Repeat("x", 2048)})
	require.NoError(t, err)
	err = p.Publish(stream+".orders", big)
	require.Error(t, err)
	bp, unroutable := refusal(err)
	require.False(t, bp, "a message larger than the stream's MaxBytes is not back-pressure: %v", err)
	require.False(t, unroutable, "%v", err)
	var api *nats.APIError
	require.ErrorAs(t, err, &api)
	require.Equal(t, codeStoreFailed, api.ErrorCode)
	require.ErrorContains(t, err, stream)
	require.ErrorContains(t, err, "MaxBytes 1024")

	require.NoError(t, p.Publish(stream+".orders", newEvent(t)), "the stream takes a message that fits")

	// At the boundary, as the server counts (headers as nats.go sends
	// them): a MaxBytes of the message's size refuses it even empty, one
	// byte more takes it.
	p.newID = func() string { return "01a24436-1fc3-77f0-84e0-dbdf49f9a47e" }
	event := newEvent(t)
	nm, err := Marshaler{}.Marshal("x", event)
	require.NoError(t, err)
	nm.Header.Set(nats.MsgIdHdr, p.newID())
	size := int64(len(nm.Data) + headerSize(nm.Header))
	exact := newStream(t, js, nats.StreamConfig{MaxBytes: size, Discard: nats.DiscardNew})
	err = p.Publish(exact+".orders", event)
	bp, _ = refusal(err)
	require.Error(t, err)
	require.False(t, bp, "%d bytes never fit a MaxBytes of %d: %v", size, size, err)
	roomy := newStream(t, js, nats.StreamConfig{MaxBytes: size + 1, Discard: nats.DiscardNew})
	require.NoError(t, p.Publish(roomy+".orders", event))
}

// TestClassifyRefusals: the errors nats.go's PublishMsg returns, by kind.
func TestClassifyRefusals(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name                     string
		err                      error
		backPressure, unroutable bool
	}{
		{"stream full (10077)", &nats.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages exceeded"}, true, false},
		{"storage exhausted (10047)", &nats.APIError{Code: 500, ErrorCode: 10047, Description: "insufficient storage resources available"}, true, false},
		{"memory exhausted (10028)", &nats.APIError{Code: 500, ErrorCode: 10028, Description: "insufficient memory resources available"}, true, false},
		{"no PubAck in time", nats.ErrTimeout, true, false},
		{"message context expired", context.DeadlineExceeded, true, false},
		{"no stream response", nats.ErrNoStreamResponse, false, true},
		{"no responders", nats.ErrNoResponders, false, true},
		{"message over the stream's max (10054)", &nats.APIError{Code: 400, ErrorCode: 10054, Description: "message size exceeds maximum allowed"}, false, false},
		{"wrong last sequence (10071)", &nats.APIError{Code: 400, ErrorCode: 10071}, false, false},
		{"connection closed", nats.ErrConnectionClosed, false, false},
		{"context canceled", context.Canceled, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := classify(c.err)
			bp, u := refusal(got)
			require.Equal(t, c.backPressure, bp, "back-pressure")
			require.Equal(t, c.unroutable, u, "unroutable")
			require.ErrorIs(t, got, c.err)
			require.Equal(t, c.err.Error(), got.Error())
		})
	}
}

func testStreamName() string {
	return "idem_" + strings.ReplaceAll(uuid.NewString()[:13], "-", "")
}
