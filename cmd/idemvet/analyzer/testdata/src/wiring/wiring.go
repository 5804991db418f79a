// Handlers attached here and declared in package handlerpkg: their
// findings are reported at the handler argument.
package wiring

import (
	"handlerpkg"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/middleware"
)

func wire(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pub message.Publisher, svc *handlerpkg.Service) {
	c.AddConsumerHandler(r, "stock", "t", sub, handlerpkg.Handle)                              // want `idemvet: write through \*pgxpool.Pool in a handler \(Exec\): use the attempt's transaction \(middleware.PgxTxFromContext\) so the effect commits with the claim \[in handler handlerpkg.Handle, handlerpkg.go:16:12\]`
	c.AddHandler(r, "billing", "t", sub, "u", pub, svc.Charge)                                 // want `HTTP call \(http.Client.Get\) in a handler outside an operation key: .* \[in handler Service.Charge, handlerpkg.go:23:12\]`
	c.AddConsumerHandler(r, "ignored", "t", sub, handlerpkg.Ignored)                           // the finding was ignored where it is
	c.AddConsumerHandler(r, "reads", "t", sub, handlerpkg.Reads)                               // reported in handlerpkg
	c.AddConsumerHandler(r, "clean", "t", sub, handlerpkg.Clean)                               // nothing to report
	c.AddConsumerHandler(r, "stock2", "t", sub, handlerpkg.Handle)                             //idemvet:ignore reviewed: the stock table is rebuilt nightly
	c.AddConsumerHandler(r, "conv", "t", sub, message.NoPublishHandlerFunc(handlerpkg.Handle)) // want `\[in handler handlerpkg.Handle, handlerpkg.go:16:12\]`
}
