// Package e2e holds the broker-level tests of the library and the example
// shop: real RabbitMQ and PostgreSQL, each test with its own schema and its
// own exchange and queues, consumers killed with SIGKILL in child processes
// (the test binary re-executed) at the library's crash points, and AMQP
// connections cut through a TCP fault proxy. The tests are in _test.go
// files; this package has no API.
package e2e
