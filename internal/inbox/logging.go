package inbox

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// invalidEventID is the rejection of a msg.UUID that is not an event id
// (permanent: the message is dead-lettered). An empty one means no envelope
// adapter decoded the message (an adapter marks a body without an event_id
// Malformed instead): the subscriber's marshaler is not the envelope's
// (Watermill's default marshalers take msg.UUID from a transport header and
// leave it "" when the producer set none), so every message would be
// dead-lettered; that is a ConfigurationError, held until the wiring is
// fixed.
func invalidEventID(id string) error {
	if id == "" {
		return &ConfigurationError{
			Hint: adapterHint,
			Err:  fmt.Errorf("%w: the message has no UUID: the subscriber does not decode the JSON envelope", ErrInvalidEventID),
		}
	}
	return fmt.Errorf("%w: %q", ErrInvalidEventID, id)
}

// adapterHint says how to make the subscriber decode the envelope, per
// transport.
const adapterHint = "configure the envelope adapter of the transport as the subscriber's unmarshaler " +
	"(watermill-amqp: Config.Marshaler = amqp.Marshaler{}; watermill-nats: SubscriberConfig.Unmarshaler = jetstream.Marshaler{} (pkg/jetstream: jetstream.Unmarshaler{}); " +
	"watermill-kafka: SubscriberConfig.Unmarshaler = kafka.Marshaler{}; watermill-redisstream: SubscriberConfig.Unmarshaller = redisstream.Marshaler{}; " +
	"packages marshaler/amqp, marshaler/jetstream, marshaler/kafka, marshaler/redisstream); the message is held until then"

// undecodedEnvelope is the error of a message whose payload is still the
// JSON envelope (its metadata holds wire.EnvelopeHeader, which every
// adapter drops when it decodes): the subscriber's unmarshaler is
// Watermill's default, and the handler would get the envelope as its
// payload.
func undecodedEnvelope() error {
	return &ConfigurationError{
		Hint: adapterHint,
		Err:  fmt.Errorf("%w: the payload is the JSON envelope itself: the subscriber does not decode it", ErrInvalidEventID),
	}
}

// commitError is the error of a COMMIT (or RELEASE SAVEPOINT) that did not
// commit. When the transaction was aborted by a statement of the handler
// (pgx.ErrTxCommitRollback, SQLSTATE 25P02 in_failed_sql_transaction), it
// also wraps ErrTxAborted: the handler's failure, not the database's.
//
// When the transaction was already ended (pgx.ErrTxClosed, sql.ErrTxDone)
// while the message context is live, only the handler can have ended it
// (it called Commit or Rollback on the attempt's transaction): see
// handlerEndedTx. (With the message context ended, database/sql rolled the
// transaction back itself: the error is returned as is and the chain gives
// the delivery back.)
//
// Otherwise the failure is classified by classifyCommitError: a typed code
// keeps its class, any other failure is the attempt's connection's
// (InfrastructureError).
func commitError(consumer string, eventID uuid.UUID, err error, cls ErrorClassifier, ctxDone bool) error {
	var pgErr *pgconn.PgError
	aborted := errors.Is(err, pgx.ErrTxCommitRollback) || (errors.As(err, &pgErr) && pgErr.Code == "25P02")
	switch {
	case aborted:
		err = fmt.Errorf("%w: %w", ErrTxAborted, err)
	case txEnded(err) && !ctxDone:
		return handlerEndedTx(err)
	case txEnded(err):
	default:
		err = classifyCommitError(err, cls)
	}
	return fmt.Errorf("%w: %s/%s: %w", ErrCommit, consumer, eventID, err)
}

// errHandlerEndedBySQL: at commit, the attempt's transaction is no longer
// the one the claim was made in: a statement of the handler ended it
// (ROLLBACK, COMMIT, END, ABORT, ROLLBACK TO our savepoint), maybe and
// began another (BEGIN, START TRANSACTION, AND CHAIN; commitguard.go). It
// wraps pgx.ErrTxClosed, so commitError reports it as handlerEndedTx
// (permanent): committing would ack a delivery whose claim is gone, or
// was committed apart from the effects that followed it.
var errHandlerEndedBySQL = fmt.Errorf("idempotency: a statement of the handler ended the attempt's transaction "+
	"(ROLLBACK, COMMIT, END, ABORT or ROLLBACK TO SAVEPOINT, maybe then BEGIN), or changed the search_path that finds an unqualified claim table: the claim is not part of it any more: %w", pgx.ErrTxClosed)

// txEnded reports whether err says the attempt's transaction was already
// committed or rolled back (pgx.ErrTxClosed, sql.ErrTxDone).
func txEnded(err error) bool { return errors.Is(err, pgx.ErrTxClosed) || errors.Is(err, sql.ErrTxDone) }

// handlerEndedTx is the error of an attempt whose handler returned nil after
// it committed or rolled back the attempt's transaction itself (a misuse:
// the middleware commits): permanent, reason "handler_ended_tx", so the
// message is poisoned once and the misuse is seen. Ordinary, it was lost
// unseen when the handler had committed: the retry found the committed
// claim and acked a duplicate, and the messages the handler produced were
// never written or returned.
func handlerEndedTx(err error) error {
	return permanent("handler_ended_tx", fmt.Errorf("idempotency: the handler ended the attempt's transaction itself "+
		"(do not Commit or Rollback it; the middleware commits): any messages it produced were not written: %w", err))
}

// singleLine returns err unchanged when its text is one line, else err
// wrapped so that its text is one line (errors.Join and pgconn's connect
// errors put each cause on its own line). The wrapper unwraps to err, so
// errors.Is and errors.As see through it.
func singleLine(err error) error {
	if err == nil {
		return nil
	}
	text := err.Error()
	if !strings.ContainsAny(text, "\r\n") {
		return err
	}
	return &oneLineError{err: err, text: oneLine(text)}
}

// oneLine joins the non-blank lines of s: after a line that ends with ':'
// with a space, otherwise with "; ".
func oneLine(s string) string {
	var b strings.Builder
	for _, line := range strings.FieldsFunc(s, func(r rune) bool { return r == '\n' || r == '\r' }) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if b.Len() > 0 {
			if strings.HasSuffix(b.String(), ":") {
				b.WriteByte(' ')
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(line)
	}
	return b.String()
}

type oneLineError struct {
	err  error
	text string
}

func (e *oneLineError) Error() string { return e.text }
func (e *oneLineError) Unwrap() error { return e.err }
