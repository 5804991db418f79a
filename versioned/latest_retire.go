package versioned

import (
	"context"
	"errors"
	"fmt"

	"github.com/watermill-idempotency/idempotency"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/internal/inbox"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Retirement: when the message a family's latest record names is poisoned at
// a consumer, it will never be applied there, and without more the latest
// record would keep making every older message of the family obsolete: the
// family would stay frozen at that consumer behind a message that no longer
// exists. the consumer's chain (or retireOnPoisonMiddleware) records the poisoned position in the
// retired table (the applied table's name + "_retired", same schema) of the
// consumer's database; the filter's verdict then ignores a latest record that
// names a retired message, so an older message that arrives later is judged
// by the applied check alone (applied when newer than what was applied). A
// newer message published afterwards moves the latest record past the
// retired one, and filtering resumes as before.

// retiredSuffix names the retired table after the applied table.
const retiredSuffix = "_retired"

// retiredTable is the retired table of applied: the same schema, the name
// with retiredSuffix (the applied name must leave room for it).
func retiredTable(applied sqldb.Ident) (sqldb.Ident, error) {
	name := applied.String() + retiredSuffix
	id, err := sqldb.ParseIdent(name)
	if err != nil {
		return sqldb.Ident{}, fmt.Errorf("the retired table %q: %w (shorten the applied table's name)", name, err)
	}
	return id, nil
}

// retiredTable is the store's retired table (AppliedTable's name +
// "_retired", in the same schema).
func (s *FamilyStore) retiredTable() sqldb.Ident { return s.retired }

// retire records, on q (a pool or a connection of the consumer's database:
// it must commit on its own, outside the failed handler transaction), that
// the message at pos of family f will never be applied by consumer (it was
// poisoned). The retired position only moves forward. LatestFilter's
// The poison step calls it; call it directly when a message of a family is
// discarded by other means.
func (s *FamilyStore) retire(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) error {
	if consumer == "" {
		return errors.New("versioned: Retire: empty consumer")
	}
	if err := checkArgs(f, pos); err != nil {
		return err
	}
	if _, err := q.Exec(ctx, s.sql.retire, s.sql.appliedArgs(consumer, f.Kind, f.ID, pos.key(), s.sql.eventID(pos.EventID))...); err != nil {
		return fmt.Errorf("versioned: retire %s of %s at %s: %w", consumer, f, pos, err)
	}
	return nil
}

// isRetired reports whether pos is consumer's retired position of f.
func (s *FamilyStore) isRetired(ctx context.Context, q sqldb.Querier, consumer string, f Family, pos Position) (bool, error) {
	var retired bool
	if err := q.QueryRow(ctx, s.sql.retired, consumer, f.Kind, f.ID, pos.key()).Scan(&retired); err != nil {
		return false, fmt.Errorf("versioned: filter %s of %s: read retired: %w", consumer, f, err)
	}
	return retired, nil
}

// handledNote is where the filter, inside the chain, tells the poison step,
// outside it, which family message went to the handler.
type handledNote struct {
	set      bool
	consumer string
	fam      Family
	pos      Position
}

type handledNoteKey struct{}

// noteHandled records, for the poison step, that the filter let the message
// at pos of fam through to the handler for consumer.
func noteHandled(ctx context.Context, consumer string, fam Family, pos Position) {
	if n, ok := ctx.Value(handledNoteKey{}).(*handledNote); ok {
		*n = handledNote{set: true, consumer: consumer, fam: fam, pos: pos}
	}
}

// retireOnPoisonMiddleware returns the middleware that retires a family message when
// it is about to be poisoned. The filter does this by default inside the
// library's chain (LatestFilterConfig.RetireDB); use this
// middleware where the poison decision is made by a chain of your own: put
// it in middleware.ConsumerConfig.AfterPoison,
// so that it sits just inside the poison middleware and sees the error the
// poison middleware acts on (after the retries). q is a pool (or connection)
// of the consumer's database, where the family store's tables are.
//
// When the inner chain returns an error that will be poisoned
// (middleware.ShouldPoison) for a message the filter had let through to the
// handler, the message's position is recorded as retired for the consumer
// (FamilyStore.Retire), before the error goes on to the poison middleware.
// From then on a latest record that names it no longer makes older messages
// obsolete at this consumer: an older message that arrives later is applied
// when newer than what was applied, and the family is never frozen behind
// the poisoned message. If the retirement itself fails, a transient error
// is joined to the handler's, so the message is not poisoned but retried
// later (the family cannot freeze through a lost retirement).
//
// Messages dropped as obsolete while the latest message was still being
// retried (before it was poisoned) are not brought back: they were acked.
func (f *LatestFilter) retireOnPoisonMiddleware(db idempotency.DB) message.HandlerMiddleware {
	var q sqldb.Querier
	if h, err := sqldb.HandleOf(db); err == nil {
		q = h.Querier()
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			note := &handledNote{}
			msg.SetContext(context.WithValue(ctx, handledNoteKey{}, note))
			out, err := h(msg)
			msg.SetContext(ctx)
			if err == nil || !note.set || !inbox.ShouldPoison(err) {
				return out, err
			}
			if rerr := f.retire(context.WithoutCancel(ctx), q, msg.UUID, note.consumer, note.fam, note.pos); rerr != nil {
				return out, errors.Join(err, inbox.Transient(rerr))
			}
			return out, err
		}
	}
}

// retire retires the message at pos of fam for consumer on q (poisoned, or
// at its last attempt before a crash loop), and logs the outcome.
func (f *LatestFilter) retire(ctx context.Context, q sqldb.Querier, eventID, consumer string, fam Family, pos Position) error {
	fields := watermill.LogFields{
		"event_id": eventID, "consumer": consumer,
		"family_kind": fam.Kind, "family_id": fam.ID, "position": pos.String(),
	}
	if err := f.cfg.Families.retire(ctx, q, consumer, fam, pos); err != nil {
		f.logger.Error("Could not retire a family message about to be poisoned (or at its last attempt before a crash loop); "+
			"retrying it instead", err, fields)
		return err
	}
	f.logger.Info("Family message retired (poisoned, or at its last attempt before a crash loop): "+
		"older messages of the family are no longer obsolete behind it", fields)
	return nil
}
