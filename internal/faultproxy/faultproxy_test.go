package faultproxy_test

import (
	"bufio"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency/internal/faultproxy"
)

func echoServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					_, _ = c.Write([]byte(line))
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(c net.Conn) error {
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_, err := bufio.NewReader(c).ReadString('\n')
	return err
}

func TestCutAndRefuse(t *testing.T) {
	t.Parallel()
	p, err := faultproxy.Start(echoServer(t))
	require.NoError(t, err)
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	require.NoError(t, roundTrip(c))
	p.Cut()
	require.Error(t, roundTrip(c), "a cut connection is dead")

	p.Refuse(time.Hour)
	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err) // the listener accepts, then closes at once
	require.Error(t, roundTrip(c2))

	p.Restore()
	c3, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	require.NoError(t, roundTrip(c3))
}
