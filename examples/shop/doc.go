// Package shop is the shared plumbing of the example shop (examples/order,
// stock, shipping, billing, indexer and the demo): the RabbitMQ topology, the
// event names and payloads the services exchange, the wiring of one
// consumer service (router, subscriber, poison publisher, the recommended
// middleware.Consumer's chain around the handler, and for services that
// produce messages their transactional outbox and its relay), and the
// operator's replay of an outbox.
//
// # Topology
//
//	producer ──► exchange "events" (topic, durable)
//	                 │ routing key = event name, e.g. "order.order.placed.v1"
//	                 ├──► queue "stock.events"    (quorum, durable) ──► stock service
//	                 │        x-dead-letter-exchange "stock.events.dlx"
//	                 ├──► queue "shipping.events" (quorum, durable) ──► shipping service
//	                 │        x-dead-letter-exchange "shipping.events.dlx"
//	                 ├──► queue "billing.events"  (quorum, durable) ──► billing service
//	                 │        x-dead-letter-exchange "billing.events.dlx"       │ its outbox and relay publish
//	                 │                                                          │ "billing.payment.confirmation_requested.v1"
//	                 ├──► queue "billing-mailer.events" ◄── (by that name) ─────┘ ──► mailer service
//	                 └──► queue "indexer.events" ◄── "catalogue.product.updated.v1" ──► indexer service
//
//	"billing.events.reconcile" (quorum, durable): billing's uncertain charges (Consumer.Reconcile)
//
//	"<queue>.dlx" (fanout, durable) ──► "<queue>.dlq" (quorum, durable)
//
// Every name gets Topology.Prefix in front, so tests and demo runs use their
// own exchanges and queues. The dead-letter exchange and queue of each
// consumer queue are declared here (watermill-amqp's default topology builder
// declares neither). They receive two kinds of messages:
//
//   - messages the middleware chain poisons (malformed deliveries, permanent
//     handler errors, non-transient errors that outlived the retries): the
//     chain's PoisonPublisher publishes them on the consumer's dead-letter
//     exchange with the reason in the "reason_poisoned" header, with publisher
//     confirms, and only then is the original delivery acked;
//   - messages the broker itself dead-letters (a consumer rejecting without
//     requeue, a quorum queue's delivery limit when Topology.DeliveryLimit is
//     set), with RabbitMQ's x-death header.
//
// # A consumer service
//
// NewService builds one consumer service from a ServiceConfig:
//
//	_ = processed.Migrate(ctx, idempotency.Pgx(pool), processed.Config{}) // before NewService
//	ob, _ := outbox.New(outbox.Config{DB: idempotency.Pgx(pool), Table: "billing_outbox"}, logger)
//	_ = ob.Migrate(ctx)
//	svc, err := shop.NewService(shop.ServiceConfig{
//		AMQPURL:        amqpURL,
//		Consumer:       billing.Consumer, // queue, bindings, Reconcile
//		Pool:           pool,             // the service's database
//		PublishHandler: bill.HandleOrderPlaced, // or Handler, when it produces nothing
//		PublishTopic:   billing.EventConfirmationRequested,
//		Outbox:         ob, // produced messages written in the handler's transaction
//		Logger:         logger,
//	})
//	go svc.Run(ctx) // consumes, and relays the outbox
//	defer svc.Close()
//
// The router's chain, outermost first: ServiceConfig.Middleware, then
// the poison layer (to the dead-letter exchange), operation.RouteUncertain (to
// the reconciliation queue, with Consumer.Reconcile), Idempotency.AfterPoison,
// retry and hold, recoverer and the claim around the handler (the one
// middleware.Consumer of the service, attached to its one router handler;
// Workers subscriptions feed that handler through Subscriptions).
//
// # Without services: SQLite and the in-process broker
//
// Every service also runs on SQLite (DB: a database/sql handle on
// modernc.org/sqlite, the pure-Go driver, with SQLiteDSN's settings) and on
// ChannelBroker, Watermill's GoChannel with an in-memory queue per consumer
// (ServiceConfig.Transport): what the demo does when no DATABASE_URL or
// AMQP_URL is set. DB is the examples' driver seam: each service keeps its SQL
// text per dialect and runs it through DB and Tx. The outboxes are the
// library's (package outbox, SQLite dialect: DB.Outbox). ChannelBroker keeps
// RabbitMQ's at-least-once behaviour (requeue on nack, redelivery of the
// deliveries whose ack a broken connection lost, dead letters) but nothing
// survives the process.
//
// # Guarantees and windows
//
//   - A poisoned message reaches the dead-letter queue once per delivery that
//     is poisoned. If the connection breaks after the poison publish was
//     confirmed and before the original delivery's ack reached the broker,
//     the broker redelivers it and it is poisoned again: the dead-letter
//     queue is at-least-once, like every queue.
//   - Transient (infrastructure) errors are never poisoned: the chain retries
//     them in process with backoff, then returns the error, the router nacks
//     and watermill-amqp requeues; the message loops with backoff until the
//     database is back. Each requeue counts as a delivery of a quorum queue:
//     RabbitMQ 4 applies a default delivery limit of 20, after which the
//     broker dead-letters the message (to the same dead-letter queue, with
//     x-death); set Topology.DeliveryLimit there to bound or widen that
//     window explicitly. RabbitMQ 3.x has no default limit.
//   - watermill-amqp hands a subscription's deliveries to the router one at a
//     time (Prefetch only pipelines the network); Workers subscriptions give
//     concurrency, and the claim key (consumer, event_id) keeps concurrent
//     deliveries of one event to one effect.
//   - With an outbox, a produced message exists if and only if the attempt
//     that produced it commits, and the relay publishes it at least once,
//     always with the event id it was written with: a crash of the relay
//     between the broker's confirm and marking the row sent republishes it.
//     A duplicate delivery of the input produces nothing (the claim skips
//     the handler). Without an outbox, the router publishes after the
//     commit and a crash in between loses the message.
//   - The reconciliation queue is at-least-once too: a redelivery of a
//     message whose operation is still uncertain routes it again; its
//     consumer deduplicates by the operation key (operation.MetadataKey).
package shop
