package kfaketest

import (
	"log"
	"os"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
)

func init() {
	if os.Getenv("KFAKE_DEBUG") != "" {
		testLogger = watermill.NewStdLogger(true, false)
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.LstdFlags)
	}
}
