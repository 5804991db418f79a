// Package idempotencytest helps users test their own handlers with the
// idempotent middleware: deliver one message twice, or n copies at once,
// through the real handler, the real middleware and the real database, and
// check that the effect happened exactly once.
//
//	func TestReserveOnce(t *testing.T) {
//		c, _ := middleware.NewConsumer(middleware.ConsumerConfig{
//			Consumer: "stock", // the claim key's consumer name
//			DB:       idempotency.Pgx(pool),
//			Poison:   middleware.PoisonConfig{Publisher: poison, Topic: "stock.poison"},
//		}, nil)
//		s := idempotencytest.Subject{
//			Handler:  idempotencytest.NoPublish(stock.Handle),
//			Consumer: c,
//			Effects: func(ctx context.Context, msg *message.Message) (int, error) {
//				var n int
//				err := pool.QueryRow(ctx, `SELECT count(*) FROM reservation WHERE event_id = $1`, msg.UUID).Scan(&n)
//				return n, err
//			},
//		}
//		idempotencytest.DeliverTwice(t, s, msg)
//		idempotencytest.DeliverConcurrently(t, s, other, 8)
//	}
//
// The helpers run the handler inside the consumer's whole chain directly, as
// a router would, with a copy of the message per delivery (same UUID, payload and metadata, a fresh
// context). No router runs.
//
// They report failures through TB.Errorf (so a test goes on and shows every
// broken expectation) and return a Report for further checks. TB is the part
// of testing.TB they use, so they can be tested themselves.
package idempotencytest
