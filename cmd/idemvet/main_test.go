package main_test

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestGoVetVettool builds idemvet and runs it the way users do, through
// go vet -vettool, on a small module whose dependencies are the analyzer's
// test stubs: the diagnostics come back as go vet's, with their positions,
// across packages (facts), and go vet fails.
func TestGoVetVettool(t *testing.T) {
	if testing.Short() && os.Getenv("CI") == "" {
		t.Skip("builds the tool and a module")
	}
	t.Parallel()
	dir := t.TempDir()
	bin := filepath.Join(dir, "idemvet")
	if runtime.GOOS == "windows" {
		bin += ".exe"
	}
	run(t, ".", "go", "build", "-o", bin, ".")

	stubs := filepath.Join("analyzer", "testdata", "src")
	mods := map[string]string{ // module path → directory under stubs
		"github.com/ThreeDotsLabs/watermill":           "github.com/ThreeDotsLabs/watermill",
		"github.com/jackc/pgx/v5":                      "github.com/jackc/pgx/v5",
		"github.com/google/uuid":                       "github.com/google/uuid",
		"github.com/watermill-idempotency/idempotency": "github.com/watermill-idempotency/idempotency",
	}
	gomod := "module example.com/shop\n\ngo 1.24\n\n"
	for mod, sub := range mods {
		dst := filepath.Join(dir, "mods", filepath.FromSlash(sub))
		copyTree(t, filepath.Join(stubs, filepath.FromSlash(sub)), dst)
		writeFile(t, filepath.Join(dst, "go.mod"), "module "+mod+"\n\ngo 1.24\n")
		version := "v0.0.0"
		if strings.HasSuffix(mod, "/v5") {
			version = "v5.0.0"
		}
		gomod += "require " + mod + " " + version + "\nreplace " + mod + " => " + filepath.ToSlash(dst) + "\n"
	}
	shop := filepath.Join(dir, "shop")
	writeFile(t, filepath.Join(shop, "go.mod"), gomod)
	writeFile(t, filepath.Join(shop, "stock.go"), `package shop

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-idempotency/idempotency/middleware"
)

func Wire(c *middleware.Consumer, r *message.Router, sub message.Subscriber, pool *pgxpool.Pool) {
	c.AddConsumerHandler(r, "reserve_stock", "order.placed", sub, func(msg *message.Message) error {
		_, err := pool.Exec(msg.Context(), "UPDATE stock SET n = n - 1")
		pool.Exec(msg.Context(), "INSERT INTO audit VALUES (1)") //idemvet:ignore the audit row outlives a rollback
		return err
	})
}
`)
	writeFile(t, filepath.Join(shop, "billing", "billing.go"), `package billing

import (
	"net/http"

	"github.com/ThreeDotsLabs/watermill/message"
)

func Charge(msg *message.Message) error {
	_, err := http.Post("https://psp.example/charges", "application/json", nil)
	return err
}
`)
	writeFile(t, filepath.Join(shop, "wire.go"), `package shop

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"example.com/shop/billing"
	"github.com/watermill-idempotency/idempotency/middleware"
)

func WireBilling(c *middleware.Consumer, r *message.Router, sub message.Subscriber) {
	c.AddConsumerHandler(r, "charge", "order.placed", sub, billing.Charge)
}
`)
	env := []string{"GOWORK=off", "GOPROXY=off", "GOFLAGS=-mod=mod", "GOTOOLCHAIN=local"}
	cmd := exec.Command("go", "vet", "-vettool="+bin, "./...")
	cmd.Dir = shop
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("go vet: want a failing exit status, got %v\n%s", err, out.String())
	}
	want := "stock.go:12:13: idemvet: write through *pgxpool.Pool in a handler (Exec): use the attempt's transaction (middleware.PgxTxFromContext) so the effect commits with the claim"
	if !strings.Contains(out.String(), want) {
		t.Errorf("go vet output lacks %q:\n%s", want, out.String())
	}
	want = "wire.go:11:57: idemvet: HTTP call (http.Post) in a handler outside an operation key: make the call inside (*operation.Runner).Do so that a redelivery does not repeat it [in handler billing.Charge, billing.go:10:12]"
	if !strings.Contains(out.String(), want) {
		t.Errorf("go vet output lacks %q:\n%s", want, out.String())
	}
	if strings.Contains(out.String(), "stock.go:13:") {
		t.Errorf("go vet reported the line with //idemvet:ignore:\n%s", out.String())
	}
}

func run(t *testing.T, dir string, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func copyTree(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
