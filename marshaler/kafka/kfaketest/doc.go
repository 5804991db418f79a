// Package kfaketest runs the Kafka adapter (marshaler/kafka) with
// watermill-kafka v3 (Sarama) against kfake, franz-go's in-process Kafka
// broker: real consumer groups, rebalances and offset commits, no Kafka
// server. It is a module of its own because kfake is published only at its
// latest version, which needs a newer Go than the adapter module declares.
package kfaketest
