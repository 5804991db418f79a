package inbox

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/marshaler"
)

// ErrInvalidProduced: a message the handler produced (returned, or published
// through PublisherFromContext) could never be relayed as an envelope: no
// event_name metadata, a msg.UUID that is not an event id, a payload that is
// not JSON, a malformed flag (marshaler.ToEnvelope refuses it). The attempt
// fails as permanent with reason "invalid_produced" and nothing it produced
// leaves it. Build produced messages with marshaler.NewMessage.
var ErrInvalidProduced = errors.New("idempotency: invalid produced message")

// ErrTxAborted: the attempt's transaction was aborted by a statement that
// failed inside it (PostgreSQL answers ROLLBACK to COMMIT, pgx
// ErrTxCommitRollback, or 25P02 to RELEASE SAVEPOINT) while the handler
// returned nil: it swallowed an SQL error. It is wrapped together with
// ErrCommit; it is the handler's failure, not the database's: retried, then
// poisoned like any handler error.
var ErrTxAborted = errors.New("idempotency: the handler returned nil but a statement of its transaction failed")

// checkProduced refuses a produced message that the outbox relay or the
// router could not deliver as an envelope.
func checkProduced(msg *message.Message) error {
	if err := marshaler.CheckEnvelope(msg); err != nil {
		id := ""
		if msg != nil {
			id = msg.UUID
		}
		return permanent("invalid_produced", fmt.Errorf("%w %q: %w (build it with marshaler.NewMessage)", ErrInvalidProduced, id, err))
	}
	return nil
}

func checkTopic(topic string) error {
	if topic == "" {
		return permanent("invalid_produced", fmt.Errorf("%w: empty topic", ErrInvalidProduced))
	}
	return nil
}
