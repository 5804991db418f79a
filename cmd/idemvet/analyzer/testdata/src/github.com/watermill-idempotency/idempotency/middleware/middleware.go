// Package middleware is a stub of the consumer door of
// github.com/watermill-idempotency/idempotency/middleware.
package middleware

import (
	"context"
	"database/sql"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-idempotency/idempotency/sqldb"
)

type Consumer struct{}

func (c *Consumer) AddConsumerHandler(router *message.Router, name, topic string, sub message.Subscriber,
	h message.NoPublishHandlerFunc) (*message.Handler, error) {
	return nil, nil
}

func (c *Consumer) AddHandler(router *message.Router, name, subTopic string, sub message.Subscriber,
	pubTopic string, pub message.Publisher, h message.HandlerFunc) (*message.Handler, error) {
	return nil, nil
}

func PgxTxFromContext(ctx context.Context) (pgx.Tx, bool)          { return nil, false }
func SQLTxFromContext(ctx context.Context) (*sql.Tx, bool)         { return nil, false }
func QuerierFromContext(ctx context.Context) (sqldb.Querier, bool) { return nil, false }
