package transporttest_test

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/internal/transporttest"
	"github.com/watermill-idempotency/idempotency/marshaler/jetstream"
)

// natsServerBin is the nats-server binary the cluster test runs (its own
// processes, never the shared server); NATS_SERVER_BIN overrides it.
func natsServerBin() string {
	if b := os.Getenv("NATS_SERVER_BIN"); b != "" {
		return b
	}
	return "/usr/sbin/nats-server"
}

// node is one nats-server process of the test's cluster.
type node struct {
	name        string
	client      int
	route       int
	dir         string
	cmd         *exec.Cmd
	exited      chan struct{}
	routes      string
	clusterName string
	log         string
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (n *node) start(t *testing.T) {
	t.Helper()
	logf, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	require.NoError(t, err)
	n.cmd = exec.Command(natsServerBin(),
		"-a", "127.0.0.1", "-p", fmt.Sprint(n.client), "-n", n.name,
		"-js", "-sd", n.dir,
		"--cluster_name", n.clusterName, "--cluster", fmt.Sprintf("nats://127.0.0.1:%d", n.route),
		"--routes", n.routes)
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	require.NoError(t, n.cmd.Start(), "start %s", natsServerBin())
	n.exited = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		_ = cmd.Wait()
		_ = logf.Close()
		close(done)
	}(n.cmd, n.exited)
}

// kill sends SIGKILL and waits for the process to be gone.
func (n *node) kill(t *testing.T) {
	t.Helper()
	select {
	case <-n.exited:
		return
	default:
	}
	require.NoError(t, n.cmd.Process.Signal(syscall.SIGKILL))
	<-n.exited
}

// startCluster starts three JetStream nodes on free loopback ports, each
// with its own storage directory, and waits until JetStream answers.
func startCluster(t *testing.T) ([]*node, string) {
	t.Helper()
	if _, err := os.Stat(natsServerBin()); err != nil {
		t.Fatalf("nats-server binary %s: %v (install the nats-server package)", natsServerBin(), err)
	}
	base := t.TempDir()
	nodes := make([]*node, 3)
	var routes, urls []string
	for i := range nodes {
		nodes[i] = &node{name: fmt.Sprintf("n%d", i), client: freePort(t), route: freePort(t),
			dir: filepath.Join(base, fmt.Sprintf("n%d", i)), clusterName: "c" + testenv.UniqueName("")[1:],
			log: filepath.Join(base, fmt.Sprintf("n%d.log", i))}
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", nodes[i].route))
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", nodes[i].client))
	}
	for _, n := range nodes {
		n.clusterName = nodes[0].clusterName
		n.routes = strings.Join(routes, ",")
		n.start(t)
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			n.kill(t)
		}
		if t.Failed() {
			for _, n := range nodes {
				b, _ := os.ReadFile(n.log)
				t.Logf("%s log (tail):\n%s", n.name, tail(string(b), 3000))
			}
		}
	})
	url := strings.Join(urls, ",")
	var nc *nats.Conn
	require.Eventually(t, func() bool {
		var err error
		nc, err = nats.Connect(url)
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "the cluster's nodes do not accept connections")
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := js.AccountInfo()
		return err == nil
	}, 30*time.Second, 100*time.Millisecond, "the JetStream cluster did not elect a meta leader")
	return nodes, url
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}

// TestJetStreamClusterLosesNodes runs a 3-node JetStream cluster with R3
// streams and consumers, two competing workers and a publisher under load,
// SIGKILLs a follower mid-stream, restarts it, then SIGKILLs the current
// stream leader: every effect exactly once, nothing left unprocessed.
func TestJetStreamClusterLosesNodes(t *testing.T) {
	t.Parallel()
	nodes, url := startCluster(t)
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond), nats.Timeout(2 * time.Second)}
	nc, err := nats.Connect(url, opts...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := nc.JetStream(nats.MaxWait(5 * time.Second))
	require.NoError(t, err)

	var stream string
	tr := transporttest.Transport{
		Name: "jetstream-r3",
		NewTopic: func(t *testing.T) transporttest.Topic {
			name := testenv.UniqueName("cl")
			group := name + "_g"
			require.Eventually(t, func() bool {
				_, err := js.AddStream(&nats.StreamConfig{Name: name, Subjects: []string{name}, Storage: nats.FileStorage, Replicas: 3})
				return err == nil
			}, 30*time.Second, 200*time.Millisecond, "R3 stream %s", name)
			_, err := js.AddConsumer(name, &nats.ConsumerConfig{
				Durable: group, DeliverSubject: nats.NewInbox(), DeliverGroup: group,
				AckPolicy: nats.AckExplicitPolicy, AckWait: time.Second, DeliverPolicy: nats.DeliverAllPolicy,
				FilterSubject: name, Replicas: 3,
			})
			require.NoError(t, err)
			if stream == "" {
				stream = name // the first topic is the one under load
			}
			jsCfg := wmnats.JetStreamConfig{DurablePrefix: group, PublishOptions: []nats.PubOpt{nats.AckWait(2 * time.Second)}}
			pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{
				URL: url, Marshaler: jetstream.Marshaler{}, JetStream: jsCfg, NatsOptions: opts,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			return transporttest.Topic{
				Name:      name,
				Publisher: pub,
				NewSubscriber: func(t *testing.T, _ string) message.Subscriber {
					sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
						URL: url, QueueGroupPrefix: group, SubscribersCount: 1,
						AckWaitTimeout: 5 * time.Second, CloseTimeout: 5 * time.Second,
						Unmarshaler: jetstream.Marshaler{}, JetStream: jsCfg, NatsOptions: opts,
					}, watermill.NopLogger{})
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					return sub
				},
				PublishRaw: func(t *testing.T, body []byte) { t.Fatal("not used") },
				Pending: func(t *testing.T) int {
					ci, err := js.ConsumerInfo(name, group)
					if err != nil {
						return -1 // no leader right now: not settled
					}
					return ci.NumAckPending + int(ci.NumPending)
				},
			}
		},
	}

	leader := func() *node {
		var found *node
		require.Eventually(t, func() bool {
			si, err := js.StreamInfo(stream)
			if err != nil || si.Cluster == nil {
				return false
			}
			for _, n := range nodes {
				if n.name == si.Cluster.Leader {
					found = n
					return true
				}
			}
			return false
		}, 30*time.Second, 100*time.Millisecond, "no stream leader")
		return found
	}
	const events = 400
	transporttest.Load(t, tr, events, 2, 30*time.Second, func(applied func() int) {
		require.Eventually(t, func() bool { return applied() >= events/4 }, 60*time.Second, 20*time.Millisecond)
		lead := leader()
		var follower *node
		for _, n := range nodes {
			if n != lead {
				follower = n
				break
			}
		}
		t.Logf("SIGKILL follower %s at %d applied", follower.name, applied())
		follower.kill(t)
		mark := applied()
		require.Eventually(t, func() bool { return applied() >= mark+events/8 }, 60*time.Second, 20*time.Millisecond,
			"no progress with one node down")
		follower.start(t)
		// Wait until the restarted node is a current replica again, so the
		// stream keeps its quorum when the leader goes.
		require.Eventually(t, func() bool {
			si, err := js.StreamInfo(stream)
			if err != nil || si.Cluster == nil {
				return false
			}
			for _, p := range si.Cluster.Replicas {
				if p.Name == follower.name {
					return p.Current
				}
			}
			return false
		}, 60*time.Second, 100*time.Millisecond, "the restarted node did not catch up")
		lead = leader()
		t.Logf("SIGKILL stream leader %s at %d applied", lead.name, applied())
		lead.kill(t)
		mark = applied()
		require.Eventually(t, func() bool { return applied() >= mark+1 || applied() == events }, 60*time.Second, 20*time.Millisecond,
			"no progress after the leader was killed")
		t.Logf("new leader %s", leader().name)
	})
}
