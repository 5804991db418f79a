package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A malformed message's repeated delivery is explained by a lost ack: a new
// connection, or on JetStream an acked copy whose AckWait ran out. A repeat
// on the same connection after a nack is a requeue, which the check counts
// against the run on every broker.
func TestMalformedRepeatsAreExplainedOnlyByALostAck(t *testing.T) {
	probe := func(ackWait bool, ds ...malformedDelivery) (int, int) {
		p := &consumerProbe{ackWaitRedelivers: ackWait, perID: map[string][]malformedDelivery{"m": ds}}
		return p.malformedDeliveries("m")
	}
	acked := func(session uint64) malformedDelivery { return malformedDelivery{session: session, acked: true} }
	nacked := func(session uint64) malformedDelivery { return malformedDelivery{session: session} }

	n, explained := probe(false, acked(1), acked(2))
	require.Equal(t, [2]int{2, 1}, [2]int{n, explained}, "a new connection explains the repeat")

	n, explained = probe(false, acked(1), acked(1))
	require.Equal(t, [2]int{2, 0}, [2]int{n, explained}, "AMQP redelivers on a live connection only after a requeue")

	n, explained = probe(true, acked(1), acked(1))
	require.Equal(t, [2]int{2, 1}, [2]int{n, explained}, "JetStream redelivers an acked copy whose AckWait ran out")

	n, explained = probe(true, nacked(1), acked(1), nacked(1), acked(1))
	require.Equal(t, [2]int{4, 1}, [2]int{n, explained}, "on JetStream too, a repeat after a nack is a requeue")
}
