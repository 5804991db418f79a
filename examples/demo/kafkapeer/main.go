// Command kafkapeer runs an in-process Kafka-protocol cluster (kfake,
// franz-go's fake Kafka) on the loopback interface for the demo's
// -backend kafka: no Kafka server to install. It prints one line,
// "kafka <host:port>[,<host:port>…]" (the brokers' addresses), then serves
// until its standard input ends (the demo closes it, or dies) or it gets
// SIGINT or SIGTERM. Topics are created on first use
// (-partitions partitions each), as Kafka's auto.create.topics.enable does.
// Everything is in memory and gone when it exits.
//
// It is a module of its own because kfake is published only at its latest
// version, which needs Go 1.26: the examples module stays at the Go version
// the library declares, and the modules that import the examples
// (internal/transporttest, e2e) do not carry kfake.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/twmb/franz-go/pkg/kfake"
)

func main() {
	brokers := flag.Int("brokers", 1, "brokers in the cluster")
	partitions := flag.Int("partitions", 4, "partitions of an automatically created topic")
	flag.Parse()
	if *brokers < 1 || *partitions < 1 {
		fmt.Fprintln(os.Stderr, "kafkapeer: -brokers and -partitions must be ≥ 1")
		os.Exit(2)
	}
	c, err := kfake.NewCluster(kfake.NumBrokers(*brokers), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(*partitions))
	if err != nil {
		fmt.Fprintln(os.Stderr, "kafkapeer:", err)
		os.Exit(2)
	}
	defer c.Close()
	fmt.Println("kafka", strings.Join(c.ListenAddrs(), ","))

	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(done)
	}()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	select {
	case <-done:
	case <-sig:
	}
}
