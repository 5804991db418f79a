package billing

import (
	"context"
	"sync"
)

// Mail is one e-mail handed to the Mailer.
type Mail struct {
	To, Subject, Body string
}

// Mailer is a fake e-mail relay, in memory, that does not honour
// idempotency keys (most SMTP relays and many e-mail APIs): every Send is
// delivered, a repeated one too, and nothing can be asked afterwards. Safe
// for concurrent use.
type Mailer struct {
	mu   sync.Mutex
	sent []Mail
}

// NewMailer returns a mailer that has sent nothing.
func NewMailer() *Mailer { return &Mailer{} }

// Send delivers m. It fails only when ctx is done on entry.
func (m *Mailer) Send(ctx context.Context, mail Mail) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sent = append(m.sent, mail)
	return nil
}

// Sent returns a copy of every mail sent, in order.
func (m *Mailer) Sent() []Mail {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Mail(nil), m.sent...)
}

// Count is the number of mails sent.
func (m *Mailer) Count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.sent)
}
