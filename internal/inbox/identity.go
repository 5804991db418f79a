package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/marshaler"
)

// Payload verification: the claim stores a fingerprint of what it applied
// (processedstore.NewIdentity: the event name and the payload bytes), and a
// duplicate is compared with it. A duplicate whose fingerprint differs is
// another event under a reused event_id: refused as permanent
// (ErrEventIDReused), never acked as a duplicate. See
// Config.DisablePayloadVerification.

// ErrEventIDReused is matched (errors.Is) by the permanent error of a message
// whose event_id was already processed by this consumer for another event:
// its event name or payload differs from what the processed row recorded (a
// producer that reused an id). Nothing is applied; the message is poisoned
// once (reason "event_id_reused"), logged at error with both event names and
// recorded as OutcomeConflict.
var ErrEventIDReused = errors.New("idempotency: event_id reused for another event")

// OutcomeConflict: the claim found the event id already processed for an
// event with another fingerprint (ErrEventIDReused); nothing applied,
// permanent.
const OutcomeConflict Outcome = "conflict"

// identityOf is the identity the claim stores for msg; false when payload
// verification is off.
func (m *Idempotent) identityOf(msg *message.Message) (processedstore.Identity, bool) {
	if m.cfg.DisablePayloadVerification {
		return processedstore.Identity{}, false
	}
	return processedstore.NewIdentity(marshaler.EventName(msg), msg.Payload), true
}

// claimQuery is the claim statement of c: with the identity columns when
// payload verification is on.
func (c claimRequest) claimQuery() (string, []any) {
	if c.verify {
		return c.store.ClaimIdentityQueryAt(c.consumer, c.eventID, c.eventAt, c.identity)
	}
	return c.store.ClaimQueryAt(c.consumer, c.eventID, c.eventAt)
}

// claim runs the claim statement of c on q.
func (c claimRequest) claim(ctx context.Context, q sqldb.Querier) (bool, error) {
	if c.verify {
		return c.store.ClaimIdentityAt(ctx, q, c.consumer, c.eventID, c.eventAt, c.identity)
	}
	return c.store.TryClaimAt(ctx, q, c.consumer, c.eventID, c.eventAt)
}

// verifyDuplicate is the duplicate path's check, on the attempt's
// transaction: it reads the row's stored identity (one primary-key lookup,
// only on this path) and returns a permanent error wrapping
// ErrEventIDReused when it recorded another event. A row without a
// fingerprint (written before the fingerprint migration, or with
// verification off) is a plain duplicate. An error reading the row is
// returned as is (not permanent: the attempt is retried).
func (m *Idempotent) verifyDuplicate(ctx context.Context, tx attemptTx, c claimRequest, fields watermill.LogFields) (conflict bool, err error) {
	if !c.verify {
		return false, nil
	}
	q, ok := QuerierFromContext(tx.bind(ctx))
	if !ok {
		return false, nil
	}
	stored, err := c.store.StoredIdentity(ctx, q, c.consumer, c.eventID)
	if err != nil {
		return false, err
	}
	return m.compareIdentity(c, stored, fields)
}

// compareIdentity is verifyDuplicate's comparison, of the identity stored in
// the row (read by StoredIdentity, or with the ROLLBACK: duplicateEnder).
func (m *Idempotent) compareIdentity(c claimRequest, stored processedstore.StoredIdentity, fields watermill.LogFields) (conflict bool, err error) {
	if !c.verify || c.identity.Verdict(stored) != processedstore.OtherEvent {
		return false, nil
	}
	as := fmt.Sprintf("as %q", stored.EventName)
	if stored.EventName == "" {
		// A UUIDv7 claim in <table>_v7 keeps the fingerprint, not the name.
		as = "with another payload or name (the name is not stored)"
	}
	err = fmt.Errorf("%w: %s/%s was processed %s, this message is %q with another fingerprint",
		ErrEventIDReused, c.consumer, c.eventID, as, c.identity.EventName)
	// Logged once, at ERROR, by finish (the rejection's line), with both
	// event names.
	setField(fields, "stored_event_name", stored.EventName)
	setField(fields, "hint", "the producer gave one event_id to two different events; this message goes to the poison topic")
	return true, err
}
