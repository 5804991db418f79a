package main

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"time"

	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/nats-io/nats.go"

	"github.com/watermill-idempotency/idempotency/examples/shop"
	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
)

// backendJetStream is PostgreSQL (DATABASE_URL) and NATS JetStream
// (NATS_URL): the shop's services on shop.JetStreamTransport, a TCP fault
// proxy in front of each consumer's NATS connection.
const backendJetStream = "jetstream"

// jetstreamBroker is the demo's broker on NATS JetStream.
type jetstreamBroker struct {
	d   *demo
	nc  *nats.Conn
	js  nats.JetStreamContext
	t   shop.JetStreamTransport
	pub message.Publisher
}

func (d *demo) newJetStreamBroker(all []shop.Consumer) (*jetstreamBroker, error) {
	b := &jetstreamBroker{d: d, t: shop.JetStreamTransport{URL: d.cfg.NATSURL, Prefix: "demo_" + d.id, Workers: d.cfg.Workers}}
	var err error
	if b.nc, err = nats.Connect(d.cfg.NATSURL); err != nil {
		return nil, fmt.Errorf("NATS at %s unreachable: %w (start nats-server -js, or set NATS_URL)", d.cfg.NATSURL, err)
	}
	d.defer_(b.nc.Close)
	if b.js, err = b.nc.JetStream(); err != nil {
		return nil, err
	}
	if err := b.t.Declare(b.js, all...); err != nil {
		return nil, fmt.Errorf("JetStream at %s: %w", d.cfg.NATSURL, err)
	}
	if !d.cfg.Keep {
		d.defer_(func() { _ = b.t.Delete(b.js, all...) })
	}
	if b.pub, err = b.t.EventsPublisher(d.logger); err != nil {
		return nil, fmt.Errorf("relay publisher: %w", err)
	}
	d.defer_(func() { _ = b.pub.Close() })
	return b, nil
}

func (b *jetstreamBroker) publisher() message.Publisher { return b.pub }

func (b *jetstreamBroker) transport(c shop.Consumer) (shop.Transport, func(), error) {
	u, err := url.Parse(b.d.cfg.NATSURL)
	if err != nil {
		return nil, nil, fmt.Errorf("NATS_URL: %w", err)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "4222")
	}
	proxy, err := faultproxy.Start(host)
	if err != nil {
		return nil, nil, err
	}
	b.d.defer_(func() { _ = proxy.Close() })
	t := b.t
	t.SubscriberURL = "nats://" + proxy.Addr()
	return t, proxy.Cut, nil
}

func (b *jetstreamBroker) publishRaw(ctx context.Context, key, id string, body []byte) error {
	subject := b.t.Subject(key)
	m := &nats.Msg{Subject: subject, Data: body, Header: nats.Header{}}
	m.Header.Set(wmnats.WatermillUUIDHdr, id)
	m.Header.Set(nats.MsgIdHdr, id+":"+subject /* the adapter's Nats-Msg-Id */)
	_, err := b.js.PublishMsg(m, nats.Context(ctx))
	return err
}

func (b *jetstreamBroker) queued(c shop.Consumer) (int, error) {
	ci, err := b.js.ConsumerInfo(b.t.EventsStream(), b.t.Durable(c))
	if err != nil {
		return 0, err
	}
	return ci.NumAckPending + int(ci.NumPending), nil
}

func (b *jetstreamBroker) reconciling(c shop.Consumer) (int, error) {
	si, err := b.js.StreamInfo(b.t.ReconcileStream(c))
	if err != nil {
		return 0, err
	}
	return int(si.State.Msgs), nil
}

// drainDeadLetters reads c's dead-letter stream and purges it.
func (b *jetstreamBroker) drainDeadLetters(c shop.Consumer) (dlqContent, error) {
	got := dlqContent{byID: map[string]int{}, withReason: map[string]int{}}
	stream := b.t.DeadLetterStream(c)
	si, err := b.js.StreamInfo(stream)
	if err != nil {
		return got, err
	}
	for seq := si.State.FirstSeq; si.State.Msgs > 0 && seq <= si.State.LastSeq; seq++ {
		m, err := b.js.GetMsg(stream, seq)
		if err != nil {
			return got, fmt.Errorf("dead letter %d of %s: %w", seq, stream, err)
		}
		id := m.Header.Get(wmnats.WatermillUUIDHdr)
		got.total++
		got.byID[id]++
		if m.Header.Get(wmw.ReasonForPoisonedKey) != "" {
			got.withReason[id]++
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return got, b.js.PurgeStream(stream, nats.Context(ctx))
}
