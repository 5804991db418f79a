// Handlers declared here and attached in package wiring.
package handlerpkg

import (
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

var Pool *pgxpool.Pool

func Handle(msg *message.Message) error { // want Handle:`handlerFindings\(pool-write at handlerpkg.go:16:12\)`
	_, err := Pool.Exec(msg.Context(), "UPDATE stock SET n = n - 1")
	return err
}

type Service struct{ Client *http.Client }

func (s *Service) Charge(msg *message.Message) ([]*message.Message, error) { // want Charge:`handlerFindings\(http-outside-op at handlerpkg.go:23:12\)`
	_, err := s.Client.Get("https://psp.example/")
	return nil, err
}

func Ignored(msg *message.Message) error {
	_, err := Pool.Exec(msg.Context(), "INSERT INTO audit VALUES (1)") //idemvet:ignore the audit row must outlive a rollback
	return err
}

// Reads reads the attempt's transaction: it is checked here, as a handler,
// and not again where it is attached.
func Reads(msg *message.Message) error {
	tx, _ := middleware.PgxTxFromContext(msg.Context())
	tx.Exec(msg.Context(), "UPDATE stock SET n = n - 1")
	_, err := Pool.Exec(msg.Context(), "INSERT INTO audit VALUES (1)") // want `write through \*pgxpool.Pool in a handler \(Exec\)`
	return err
}

func Clean(msg *message.Message) error {
	tx, _ := middleware.PgxTxFromContext(msg.Context())
	_, err := tx.Exec(msg.Context(), "UPDATE stock SET n = n - 1")
	return err
}

// Not attached anywhere: a finding recorded but never reported.
func Unused(msg *message.Message) error { // want Unused:`handlerFindings\(pool-write at handlerpkg.go:49:12\)`
	_, err := Pool.Exec(msg.Context(), "DELETE FROM t")
	return err
}
