// Rule http-outside-op: HTTP calls in a handler outside an operation key.
package httpcall

import (
	"context"
	"net/http"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/operation"
)

type billing struct {
	client *http.Client
	runner *operation.Runner
}

func (b *billing) register(c *middleware.Consumer, r *message.Router, sub message.Subscriber) {
	c.AddConsumerHandler(r, "charge", "order.placed", sub, b.handle)
}

func (b *billing) handle(msg *message.Message) error {
	ctx := msg.Context()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://psp.example/charges", nil)
	b.client.Do(req)                               // want `idemvet: HTTP call \(http.Client.Do\) in a handler outside an operation key: make the call inside \(\*operation.Runner\).Do so that a redelivery does not repeat it`
	http.DefaultClient.Do(req)                     // want `HTTP call \(http.Client.Do\)`
	http.Get("https://psp.example/")               // want `HTTP call \(http.Get\)`
	http.Post("https://psp.example/", "", nil)     // want `HTTP call \(http.Post\)`
	http.PostForm("https://psp.example/", nil)     // want `HTTP call \(http.PostForm\)`
	b.client.Head("https://psp.example/")          // want `HTTP call \(http.Client.Head\)`
	notify := func() { b.client.Get("https://x") } // want `HTTP call \(http.Client.Get\)`
	notify()

	key := operation.MustKey("charge", "o-42")
	// Inside an operation key: a literal passed to Run or Do, a variable
	// bound to one, and what they call.
	b.runner.Run(ctx, key, nil, func(ctx context.Context, k string) (operation.Result, error) {
		resp, err := b.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return operation.Result{}, b.callPSP(ctx, k)
	})
	charge := func(ctx context.Context, k string) (operation.Result, error) {
		_, err := b.client.Post("https://psp.example/charges", "application/json", strings.NewReader("{}"))
		return operation.Result{}, err
	}
	b.runner.Do(ctx, key, nil, charge)
	b.runner.Do(ctx, key, nil, b.namedCall) // not followed: a value, not a call

	// One level: a function of the package the handler calls with its ctx.
	return b.post(ctx, "k")
}

func (b *billing) post(ctx context.Context, key string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://psp.example/charges", nil)
	req.Header.Set("Idempotency-Key", key)
	_, err := b.client.Do(req) // want `HTTP call \(http.Client.Do\)`
	return err
}

// callPSP is called only inside an operation key.
func (b *billing) callPSP(ctx context.Context, key string) error {
	_, err := http.Post("https://psp.example/charges", "application/json", nil)
	return err
}

func (b *billing) namedCall(ctx context.Context, k string) (operation.Result, error) {
	_, err := http.Get("https://psp.example/")
	return operation.Result{}, err
}

// Not a handler: a health check, a client of the service.
func ping(ctx context.Context, client *http.Client) error {
	_, err := client.Get("https://psp.example/health")
	return err
}
