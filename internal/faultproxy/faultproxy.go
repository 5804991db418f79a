// Package faultproxy is a TCP proxy on loopback for fault-injection tests and
// the demo: put it between a client and PostgreSQL or RabbitMQ, then cut every
// connection, or refuse new ones for a while, without touching the shared
// service.
package faultproxy

import (
	"errors"
	"net"
	"sync"
	"time"
)

// Proxy forwards TCP connections from its own loopback address to a target.
type Proxy struct {
	target string
	ln     net.Listener

	mu          sync.Mutex
	conns       map[net.Conn]struct{}
	refuseUntil time.Time
	hung        chan struct{} // non-nil while Hang holds the data; Resume closes it
	closed      bool
	wg          sync.WaitGroup
}

// Start listens on 127.0.0.1 (a free port) and forwards to target
// ("127.0.0.1:5432"). Close stops it.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the proxy's port.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Cut closes every open connection in both directions (clients see a reset
// or EOF); new connections are accepted as before.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// Refuse cuts every connection and closes new ones at once for d.
func (p *Proxy) Refuse(d time.Duration) {
	p.mu.Lock()
	p.refuseUntil = time.Now().Add(d)
	p.mu.Unlock()
	p.Cut()
}

// Restore ends a Refuse early.
func (p *Proxy) Restore() {
	p.mu.Lock()
	p.refuseUntil = time.Time{}
	p.mu.Unlock()
}

// Hang stops forwarding in both directions without closing anything: the
// connections stay open, what either side sends is read and held, as when a
// server stops reading (RabbitMQ blocking a connection on a memory or disk
// alarm) or the network stalls. Resume forwards what was held.
func (p *Proxy) Hang() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.hung == nil {
		p.hung = make(chan struct{})
	}
}

// Resume ends a Hang.
func (p *Proxy) Resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.hung != nil {
		close(p.hung)
		p.hung = nil
	}
}

// Close stops listening, cuts every connection and waits for its goroutines.
func (p *Proxy) Close() error {
	p.Resume()
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.Cut()
	p.wg.Wait()
	return err
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || time.Now().Before(p.refuseUntil) {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		if !p.track(client) {
			_ = client.Close()
			continue
		}
		server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil || !p.track(server) {
			if server != nil {
				_ = server.Close()
			}
			p.untrack(client)
			_ = client.Close()
			continue
		}
		p.wg.Add(2)
		go p.pipe(client, server)
		go p.pipe(server, client)
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			hung := p.hung
			p.mu.Unlock()
			if hung != nil {
				<-hung
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
	p.untrack(dst)
	p.untrack(src)
}
