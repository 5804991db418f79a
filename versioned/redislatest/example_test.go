package redislatest_test

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-idempotency/idempotency/versioned"
	"github.com/watermill-idempotency/idempotency/versioned/redislatest"
)

// A producer records the latest message of each family in Redis as it
// publishes; consumers read the same store in their versioned.LatestFilter
// (LatestFilterConfig.Latest) and drop superseded messages.
func ExampleNew() {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()
	store, err := redislatest.New(redislatest.Config{Client: client, TTL: 24 * time.Hour})
	if err != nil {
		panic(err)
	}
	pub, err := versioned.NewLatestPublisher(gochannel.NewGoChannel(gochannel.Config{}, nil), versioned.LatestPublisherConfig{Store: store}, nil)
	if err != nil {
		panic(err)
	}
	defer pub.Close()
}
