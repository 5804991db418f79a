package marshaler

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// corePackages must link no transport client: a NATS or Kafka user of the
// middleware must not link RabbitMQ code, and the other way round. The
// transport adapters (marshaler/amqp, marshaler/jetstream, …) are leaf
// packages the core never imports.
var corePackages = []string{
	"github.com/watermill-idempotency/idempotency/marshaler",
	"github.com/watermill-idempotency/idempotency/internal/inbox",
	"github.com/watermill-idempotency/idempotency/internal/processedstore",
	"github.com/watermill-idempotency/idempotency/outbox",
}

// transportModules are the import path prefixes of transport clients and of
// this module's adapters.
var transportModules = []string{
	"github.com/rabbitmq/amqp091-go",
	"github.com/ThreeDotsLabs/watermill-amqp",
	"github.com/ThreeDotsLabs/watermill-nats",
	"github.com/nats-io/",
	"github.com/ThreeDotsLabs/watermill-redisstream",
	"github.com/redis/go-redis",
	"github.com/ThreeDotsLabs/watermill-kafka",
	"github.com/IBM/sarama",
	"github.com/Shopify/sarama",
	"github.com/segmentio/kafka-go",
	"github.com/watermill-idempotency/idempotency/marshaler/",
}

// TestCoreLinksNoTransport runs `go list -deps` on each core package (not
// its tests, which may use a broker) and fails on any transport client or
// adapter among the dependencies.
func TestCoreLinksNoTransport(t *testing.T) {
	t.Parallel()
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	for _, pkg := range corePackages {
		out, err := exec.Command(goBin, "list", "-deps", pkg).CombinedOutput()
		require.NoError(t, err, "go list -deps %s: %s", pkg, out)
		for _, dep := range strings.Fields(string(out)) {
			for _, bad := range transportModules {
				require.False(t, strings.HasPrefix(dep, bad), "%s links %s (a transport client or adapter)", pkg, dep)
			}
		}
	}
}
