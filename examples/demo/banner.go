package main

import (
	"fmt"
	"net/url"
)

// backendLine names the backend a run uses, for the first line of its
// output (the JSON line, last, carries "backend" too): which databases and
// broker, with passwords redacted.
func backendLine(cfg config) string {
	switch cfg.Backend {
	case backendEmbedded:
		return "backend embedded: SQLite files, in-process broker (Watermill gochannel)"
	case backendServices:
		return fmt.Sprintf("backend services: PostgreSQL %s, RabbitMQ %s", redact(cfg.DatabaseURL), redact(cfg.AMQPURL))
	case backendJetStream:
		return fmt.Sprintf("backend jetstream: PostgreSQL %s, NATS JetStream %s", redact(cfg.DatabaseURL), redact(cfg.NATSURL))
	case backendKafka:
		return fmt.Sprintf("backend kafka: PostgreSQL %s, in-process Kafka-protocol cluster (kfake, examples/demo/kafkapeer)", redact(cfg.DatabaseURL))
	default:
		return "backend " + cfg.Backend + ":"
	}
}

// redact hides the password of a URL ("guest:xxxxx@…").
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}
