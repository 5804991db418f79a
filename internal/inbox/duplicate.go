package inbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// duplicateEnder is an attempt's transaction that can end a claim that
// inserted nothing in one round trip: the row's stored identity is read
// and the transaction rolled back together (the pipelined pgx beginner's
// pgxTx). Other beginners end it with one statement each (Verdict,
// StoredIdentity, ROLLBACK).
type duplicateEnder interface {
	readAndRollback(ctx context.Context, query string, args []any, key identityKey, name, fp *[]byte) (found bool, err error)
	afterEnd() sqldb.Querier
	attemptTx
}

// identityKey is the stored-identity read's parameters unboxed, for the
// prepared read (pgxtx.go): $1 the consumer, $2 the event id.
type identityKey struct {
	consumer string
	eventID  uuid.UUID
}

// endDuplicate ends the attempt of a claim that inserted nothing, on d:
// one round trip reads the row (event name, fingerprint) and rolls back.
// A row → a duplicate, compared with this message's identity (a conflict
// is OutcomeConflict, reason "event_id_reused"). No row → the claim was
// refused by the replay window (a purge removes only expired rows, and the
// read's own snapshot sees a row committed by a claim this one waited on),
// and one more statement, only on this rare path, asks the store's Verdict
// why, on the database clock. Results as refused: reason "" with an error
// means the attempt's connection failed (retry).
func (m *Idempotent) endDuplicate(ctx context.Context, d duplicateEnder, req claimRequest, fields watermill.LogFields) (Outcome, string, error) {
	if !req.verify && m.cfg.Store.Horizon() <= 0 {
		// Nothing to read: a duplicate.
		if err := rollback(ctx, d); err != nil {
			m.logger.Debug("Rollback after duplicate failed", fields.Add(watermill.LogFields{"error": oneLine(err.Error())}))
		}
		return "", "", nil
	}
	var name, fp []byte
	query, args := req.store.StoredIdentityQuery(req.consumer, req.eventID)
	found, err := d.readAndRollback(ctx, query, args, identityKey{req.consumer, req.eventID}, &name, &fp)
	if err != nil {
		return OutcomeFailed, "", err
	}
	if !found {
		if m.cfg.Store.Horizon() <= 0 {
			return "", "", nil
		}
		return m.refusal(m.cfg.Store.Verdict(ctx, d.afterEnd(), req.consumer, req.eventID, req.eventAt), fields)
	}
	stored := processedstore.StoredIdentity{Found: true, EventName: string(name), Fingerprint: fp}
	if conflict, cErr := m.compareIdentity(req, stored, fields); conflict {
		return OutcomeConflict, "event_id_reused", cErr
	}
	return "", "", nil
}
