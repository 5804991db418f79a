// Package billing is a consumer of the example shop that has external
// effects: for each placed order it charges a payment provider once, and it
// sends one confirmation e-mail per charge.
//
// # The charge: an operation key
//
// The provider is not in our database, so the consumer attempt's
// transaction cannot make the charge happen once: a crash after the provider
// accepted, or a timeout, leaves a charge the database does not know about,
// and the order event comes back. HandleOrderPlaced charges through
// operation.Runner.Do with the key "charge:<order_id>": the same for every
// delivery, retry and replay, and passed to the provider as its idempotency
// key. The key's record is committed, on the runner's own connection, before
// the provider is called; the amount and currency are fingerprinted, so an
// event that reuses the order's key for another amount is refused
// (operation.ErrConflict, permanent: the dead-letter queue) before any call.
//
// When the provider times out (Provider.InjectTimeouts), the charge may have
// been made. The runner records the key as uncertain and returns a transient
// error; the retry calls Service.Reconcile, which asks the provider for the
// charge by key, finds it and records it. No second charge is ever requested
// on a guess. If the process dies between the provider's answer and the
// record, the next attempt finds the key started by a dead owner and
// reconciles the same way.
//
// The local ledger row (billing_payment) is written in the middleware's
// transaction, after the charge; it commits with the event's claim.
//
// # The e-mail: a separate message, produced after the commit
//
// The Mailer does not honour idempotency keys and cannot be asked what it
// sent, so nothing can reconcile an e-mail: if it goes out and the process
// dies before recording it, it goes out again. That is why the handler that
// charges does not send it:
//
//   - Sent from HandleOrderPlaced, the e-mail would leave before the
//     transaction commits. If the commit (or anything after the send) fails,
//     the attempt rolls back and is retried: one e-mail per attempt, and an
//     e-mail announcing a payment whose local record then does not exist.
//   - Instead, HandleOrderPlaced returns an EventConfirmationRequested
//     message. With the middleware's outbox it is written in the same
//     transaction as the claim and the ledger row, and relayed only if that
//     commits; without an outbox the router publishes it after the commit
//     (a crash in between loses it: use the outbox). Either way the request
//     for an e-mail exists only once the payment is recorded.
//   - Its event id is derived from the charge key (ConfirmationEventID), so
//     every attempt, and every event that replays the order, produces the
//     same confirmation, and the mailer's consumer (HandleConfirmation, through
//     its middleware.Consumer) sends one e-mail per charge.
//   - A failing mailer retries on its own message and never re-runs the
//     payment handler.
//
// The remaining window: HandleConfirmation's process dying after the Mailer
// accepted and before its claim commits sends the e-mail again on redelivery
// (at least once). For a confirmation, a rare duplicate is the right side to
// err on; an effect where a duplicate is worse than a loss would go through
// operation.Runner.Do without a reconcile function instead, turning the crash
// into an uncertain outcome for a person to check.
//
// # Wiring
//
// Two handlers, each through a consumer of its own (middleware.NewConsumer:
// the whole chain) with operation.RouteUncertain in its
// ConsumerConfig.AfterPoison: HandleOrderPlaced on the
// order events (consumer Consumer.Name, publishing to
// EventConfirmationRequested through the consumer's outbox), and
// HandleConfirmation on those (consumer MailerConsumer.Name). With the
// example shop's plumbing, as the demo (examples/demo) wires it:
//
//	runner, _ := operation.NewRunner(operation.Config{DB: idempotency.Pgx(runnerPool)}, logger) // small pool of its own, same schema
//	_ = billing.Migrate(ctx, pool, processed.Config{}, runner) // processed table, operations, ledger
//	ob, _ := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "billing_outbox"}, logger)
//	_ = ob.Migrate(ctx)
//	svc, _ := billing.New(billing.Config{Runner: runner, Provider: provider, Mailer: mailer, Logger: logger})
//	charge, _ := shop.NewService(shop.ServiceConfig{ // queue "billing.events" and its reconciliation queue
//		AMQPURL: amqpURL, Consumer: billing.Consumer, Pool: pool,
//		PublishHandler: svc.HandleOrderPlaced, PublishTopic: billing.EventConfirmationRequested,
//		Outbox: ob, // the confirmation is written in the claim's transaction; the service relays it
//	})
//	mail, _ := shop.NewService(shop.ServiceConfig{ // queue "billing-mailer.events"
//		AMQPURL: amqpURL, Consumer: billing.MailerConsumer, Pool: pool, Handler: svc.HandleConfirmation,
//	})
//
// Consumer.Reconcile makes shop.NewService route uncertain charges to
// "billing.events.reconcile" (operation.RouteUncertain). Provider.Charges
// should equal ExpectedCharges, and Mailer.Count too, once every message is
// handled.
package billing
