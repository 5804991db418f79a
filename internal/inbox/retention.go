package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/watermill-idempotency/idempotency/internal/processedstore"
)

// OutcomeFuture: the claim refused an event dated further ahead of the
// database clock than processedstore.Config.MaxFutureSkew (its producer's clock
// is wrong); permanent, logged at ERROR.
const OutcomeFuture Outcome = "future"

// ErrFuture: the event is dated after the database's now() +
// processedstore.Config.MaxFutureSkew; refused by the claim. Permanent (it
// reaches the poison topic once; re-drive it when its producer's clock is
// fixed, or when its time has come).
var ErrFuture = errors.New("idempotency: event dated too far in the future")

// checkHorizon refuses a deprecated ReplayHorizon that disagrees with the
// store's horizon, which is the one the claim enforces.
func checkHorizon(cfg Config) error {
	if cfg.ReplayHorizon > 0 && cfg.ReplayHorizon != cfg.Store.Horizon() {
		return fmt.Errorf("middleware: Config.ReplayHorizon %s differs from the store's processedstore.Config.Horizon %s: set the horizon once, on the store (the claim enforces it by the database clock)",
			cfg.ReplayHorizon, cfg.Store.Horizon())
	}
	return nil
}

// refused explains a claim that inserted nothing (processedstore.Store.Verdict,
// in the attempt's transaction): nil for a duplicate; for a refused event,
// its outcome, reason and a permanent-to-be error; reason "" when the
// verdict itself failed (an error to retry).
func (m *Idempotent) refused(ctx context.Context, tx attemptTx, consumer string, id uuid.UUID, at time.Time, fields watermill.LogFields) (Outcome, string, error) {
	if m.cfg.Store.Horizon() <= 0 {
		return "", "", nil
	}
	q, _ := QuerierFromContext(tx.bind(ctx))
	return m.refusal(m.cfg.Store.Verdict(ctx, q, consumer, id, at), fields)
}

// refusal maps a verdict (processedstore.Store.Verdict) to refused's results.
func (m *Idempotent) refusal(err error, fields watermill.LogFields) (Outcome, string, error) {
	switch {
	case err == nil:
		return "", "", nil
	case errors.Is(err, processedstore.ErrExpired):
		return OutcomeExpired, "expired", fmt.Errorf("%w: %w", ErrExpired, err)
	case errors.Is(err, processedstore.ErrFuture):
		// Logged once, at ERROR, by finish (the rejection's line).
		setField(fields, "hint", "the event is dated after the database clock plus MaxFutureSkew: its producer's clock is wrong")
		return OutcomeFuture, "future", fmt.Errorf("%w: %w", ErrFuture, err)
	default:
		return OutcomeFailed, "", err // classified by the caller (the attempt's connection)
	}
}
