package operation_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/sqldb"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/operation"
)

// runnerEnv is a migrated Runner on a fresh database of one target
// (testenv.TargetNames), with the target's handles.
type runnerEnv struct {
	testenv.Target
	r *operation.Runner
}

// runnerOn builds a Runner of cfg on tg (its Pool for postgres-pgx, its DB
// otherwise) and migrates it.
func runnerOn(t *testing.T, tg testenv.Target, cfg operation.Config) *runnerEnv {
	t.Helper()
	if tg.Pgx != nil {
		cfg.DB = idempotency.Pgx(tg.Pgx)
	} else {
		cfg.DB = idempotency.SQL(tg.Std, tg.Dialect)
	}
	r, err := operation.NewRunner(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, r.Migrate(context.Background()))
	return &runnerEnv{Target: tg, r: r}
}

// eachRunner runs fn once per target, in parallel subtests, each with a
// migrated Runner of cfg on a fresh database.
func eachRunner(t *testing.T, cfg operation.Config, fn func(t *testing.T, e *runnerEnv)) {
	testenv.EachTarget(t, func(t *testing.T, tg testenv.Target) { fn(t, runnerOn(t, tg, cfg)) })
}

// errTimeout is what the fake provider's client sees when the provider
// charged but the answer never came.
var (
	errTimeout     = errors.New("provider: read timeout")
	errDeclined    = errors.New("provider: card declined")
	errUnavailable = errors.New("provider: 503 unavailable")
)

type charge struct {
	ID       string `json:"id"`
	Key      string `json:"key"`
	Amount   string `json:"amount"`
	Currency string `json:"currency"`
}

// provider is a fake payment provider that honours idempotency keys: a
// second charge with a known key returns the first charge and charges
// nothing. It records every key it sees, in order.
type provider struct {
	mu      sync.Mutex
	charges map[string]charge
	calls   int      // Charge calls
	lookups int      // Lookup calls
	seen    []string // keys of Charge and Lookup calls, in order

	timeouts    int // the next n Charge calls charge, then report errTimeout
	unavailable int // the next n Charge calls fail with errUnavailable (no charge)
	declines    int // the next n Charge calls are declined (no charge)

	// entered, when set, receives one value per Charge call, before block.
	entered chan string
	// block, when set, is waited on by every Charge call after counting.
	block chan struct{}
}

func newProvider() *provider { return &provider{charges: map[string]charge{}} }

func (p *provider) Charge(ctx context.Context, key, amount, currency string) (charge, error) {
	p.mu.Lock()
	p.calls++
	p.seen = append(p.seen, "charge "+key)
	entered, block := p.entered, p.block
	p.mu.Unlock()
	if entered != nil {
		entered <- key
	}
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return charge{}, ctx.Err()
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.unavailable > 0:
		p.unavailable--
		return charge{}, errUnavailable
	case p.declines > 0:
		p.declines--
		return charge{}, errDeclined
	}
	c, ok := p.charges[key]
	if !ok {
		c = charge{ID: fmt.Sprintf("ch_%d", len(p.charges)+1), Key: key, Amount: amount, Currency: currency}
		p.charges[key] = c
	}
	if p.timeouts > 0 {
		p.timeouts--
		return charge{}, errTimeout
	}
	return c, nil
}

func (p *provider) Lookup(_ context.Context, key string) (charge, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lookups++
	p.seen = append(p.seen, "lookup "+key)
	c, ok := p.charges[key]
	return c, ok
}

// counts returns (distinct charges made, Charge calls, Lookup calls).
func (p *provider) counts() (charges, calls, lookups int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.charges), p.calls, p.lookups
}

func (p *provider) seenKeys() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.seen...)
}

// call is the CallFunc of a charge, classifying the provider's errors.
func (p *provider) call(amount, currency string) operation.CallFunc {
	return func(ctx context.Context, key string) (operation.Result, error) {
		c, err := p.Charge(ctx, key, amount, currency)
		return chargeResult(c, err)
	}
}

func chargeResult(c charge, err error) (operation.Result, error) {
	switch {
	case errors.Is(err, errDeclined):
		return operation.Result{}, operation.Rejected(err)
	case errors.Is(err, errUnavailable):
		return operation.Result{}, operation.Transient(err)
	case err != nil:
		return operation.Result{}, operation.Timeout(err)
	}
	data, _ := json.Marshal(c)
	return operation.Result{Reference: c.ID, Data: data}, nil
}

// reconcile is the ReconcileFunc: a lookup by key.
func (p *provider) reconcile(ctx context.Context, rec operation.Record) (operation.Result, error) {
	c, ok := p.Lookup(ctx, rec.Key)
	if !ok {
		return operation.Result{}, operation.ErrNotFound
	}
	data, _ := json.Marshal(c)
	return operation.Result{Reference: c.ID, Data: data}, nil
}

// ServeHTTP exposes the provider to another process: POST /charge with
// key, amount, currency form values; GET /lookup?key=….
func (p *provider) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	key := req.FormValue("key")
	switch req.URL.Path {
	case "/charge":
		c, err := p.Charge(req.Context(), key, req.FormValue("amount"), req.FormValue("currency"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(c)
	case "/lookup":
		c, ok := p.Lookup(req.Context(), key)
		if !ok {
			http.NotFound(w, req)
			return
		}
		_ = json.NewEncoder(w).Encode(c)
	default:
		http.NotFound(w, req)
	}
}

// httpProvider is the client side of ServeHTTP.
type httpProvider struct{ base string }

func (h httpProvider) call(amount, currency string) operation.CallFunc {
	return func(ctx context.Context, key string) (operation.Result, error) {
		form := url.Values{"key": {key}, "amount": {amount}, "currency": {currency}}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.base+"/charge?"+form.Encode(), nil)
		if err != nil {
			return operation.Result{}, operation.Rejected(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return operation.Result{}, operation.Timeout(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return operation.Result{}, operation.Timeout(fmt.Errorf("charge: HTTP %d", resp.StatusCode))
		}
		var c charge
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return operation.Result{}, operation.Timeout(err)
		}
		return operation.Result{Reference: c.ID}, nil
	}
}

func (h httpProvider) reconcile(ctx context.Context, rec operation.Record) (operation.Result, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.base+"/lookup?key="+url.QueryEscape(rec.Key), nil)
	if err != nil {
		return operation.Result{}, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return operation.Result{}, operation.Transient(err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		var c charge
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return operation.Result{}, operation.Transient(err)
		}
		return operation.Result{Reference: c.ID}, nil
	case http.StatusNotFound:
		return operation.Result{}, operation.ErrNotFound
	default:
		return operation.Result{}, operation.Transient(fmt.Errorf("lookup: HTTP %d", resp.StatusCode))
	}
}

// eventually polls cond until it holds or 10s pass; the failure names what
// it waited for and what cond saw last (testenv.Eventually).
func eventually(t *testing.T, what string, cond func(o *testenv.Observed) bool) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, what, cond)
}

// lockWaiters counts attempts waiting for the lock of key: sessions
// waiting for its advisory lock (PostgreSQL) or in GET_LOCK (MySQL: the
// processlist's "User lock" state, in the target's database), or waiters of
// the process lock (SQLite).
func (e *runnerEnv) lockWaiters(t *testing.T, key operation.Key) int {
	t.Helper()
	ctx := context.Background()
	var n int
	switch e.Dialect {
	case sqldb.PostgreSQL:
		id := e.pgLockID(t, key)
		require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 1`,
			int64(id>>32), int64(id&0xFFFFFFFF)).Scan(&n))
	case sqldb.MySQL:
		require.NoError(t, e.DB.QueryRow(ctx, `SELECT count(*) FROM information_schema.PROCESSLIST
WHERE db = ? AND state = 'User lock' AND info LIKE 'SELECT GET_LOCK%'`, e.Database).Scan(&n))
	default:
		n = operation.ProcessLockWaiters(e.Database, e.r.Table(), key)
	}
	return n
}

// pgLockID is the advisory lock number of key on the runner's table.
func (e *runnerEnv) pgLockID(t *testing.T, key operation.Key) uint64 {
	t.Helper()
	var id int64
	require.NoError(t, e.DB.QueryRow(context.Background(), `SELECT `+operation.PgLockKey,
		key.String(), `"`+strings.ReplaceAll(e.r.Table(), ".", `"."`)+`"`).Scan(&id))
	return uint64(id)
}

func mustKey(t *testing.T, kind, entity string, intent ...string) operation.Key {
	t.Helper()
	k, err := operation.NewKey(kind, entity, intent...)
	require.NoError(t, err)
	return k
}
