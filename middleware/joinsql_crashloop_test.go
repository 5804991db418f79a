package middleware_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	idempotency "github.com/watermill-idempotency/idempotency"
	"github.com/watermill-idempotency/idempotency/internal/testenv"
	"github.com/watermill-idempotency/idempotency/marshaler"
	"github.com/watermill-idempotency/idempotency/middleware"
	"github.com/watermill-idempotency/idempotency/processed"
)

const joinedCrashChildEnv = "IDEMPOTENCY_JOINED_CRASH_CHILD"

// TestJoinedCrashLoopIsDeadLetteredWhateverComesBeforeItInTheBatch: a
// message that kills the process, consumed through watermill-sql's
// subscriber with ConsumerConfig.JoinSQLSubscriber, is dead-lettered after
// MaxCrashes deaths however many messages not processed yet come before it
// in its batch (the queue schema reads 100 at a time). The batch is one
// transaction, so a death rolls back every message before the killer and
// each restart attempts them again as new: with the killer 71st, they
// spent the first 64 counted attempts of each start (the warm-up) and the
// killer was never counted, on the old code: every process died on it and
// nothing of the batch was ever applied. Joined attempts are now all
// counted. Child processes SIGKILL themselves on the "kill" event.
func TestJoinedCrashLoopIsDeadLetteredWhateverComesBeforeItInTheBatch(t *testing.T) {
	if os.Getenv(joinedCrashChildEnv) != "" {
		os.Exit(joinedCrashChild())
	}
	// 10: the killer within the warm-up (the control: dead-lettered);
	// 70: beyond it (never dead-lettered).
	for _, before := range []int{10, 70} {
		t.Run(fmt.Sprintf("%d-before-the-killer", before), func(t *testing.T) { joinedCrashLoop(t, before) })
	}
}

func joinedCrashLoop(t *testing.T, before int) {
	ctx := context.Background()
	pool, schema := testenv.Pool(t)
	db := idempotency.Pgx(pool)
	require.NoError(t, processed.Migrate(ctx, db, processed.Config{}))
	_, err := pool.Exec(ctx, `CREATE TABLE effect (event_id text NOT NULL, note text)`)
	require.NoError(t, err)
	beginner := wsql.BeginnerFromPgx(pool)
	pub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}, AutoInitializeSchema: true}, watermill.NopLogger{})
	require.NoError(t, err)

	const after = 3
	var batch []*message.Message
	for i := 0; i < before+1+after; i++ {
		kind := "ok"
		if i == before {
			kind = "kill"
		}
		m, err := marshaler.NewMessage("order.placed", map[string]any{"i": i, "kind": kind})
		require.NoError(t, err)
		batch = append(batch, m)
	}
	require.NoError(t, pub.Publish("orders", batch...))

	count := func(q string) int {
		var n int
		if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	effects := func() int { return count(`SELECT count(*) FROM effect`) }
	deadLetters := func() int { return count(`SELECT count(*) FROM watermill_poison`) }

	const maxCrashes = 3
	deaths := 0
	for run := 0; run < maxCrashes+5; run++ {
		cmd := exec.Command(os.Args[0], "-test.run=^TestJoinedCrashLoopIsDeadLetteredWhateverComesBeforeItInTheBatch$")
		cmd.Env = append(os.Environ(), joinedCrashChildEnv+"=1", "IDEMPOTENCY_JOINED_CHILD_SCHEMA="+schema,
			fmt.Sprintf("IDEMPOTENCY_JOINED_CHILD_EXPECT=%d", before+after))
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok && ee.Sys().(syscall.WaitStatus).Signaled() {
			deaths++
		} else if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		t.Logf("run %d: killed=%v effects=%d dead letters=%d", run+1, err != nil, effects(), deadLetters())
		if effects() == before+after && deadLetters() >= 1 {
			break
		}
	}
	require.Equal(t, 1, deadLetters(), "the killer is dead-lettered once (crash_loop) after MaxCrashes deaths")
	require.Equal(t, before+after, effects(), "every other message is applied")
	require.LessOrEqual(t, deaths, maxCrashes+1, "the process dies at most MaxCrashes+1 times")
}

// joinedCrashChild is one consumer process: watermill-sql subscriber on
// the queue schema, the consumer joined to its transaction, MaxCrashes 3
// (the default); the handler SIGKILLs the process on the "kill" event.
func joinedCrashChild() int {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = os.Getenv("IDEMPOTENCY_JOINED_CHILD_SCHEMA")
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	logger := watermill.NopLogger{}
	beginner := wsql.BeginnerFromPgx(pool)
	sub, err := queueSubscriber(beginner, nil, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	poison, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	c, err := middleware.NewConsumer(middleware.ConsumerConfig{
		Consumer: "stock", DB: idempotency.Pgx(pool), JoinSQLSubscriber: true,
		Poison: middleware.PoisonConfig{Publisher: poison, Topic: "poison"},
	}, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	_, err = c.AddConsumerHandler(r, "reserve", "orders", sub, func(msg *message.Message) error {
		var body struct {
			Kind string `json:"kind"`
		}
		_ = json.Unmarshal(msg.Payload, &body)
		if body.Kind == "kill" {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // an OOM kill
			select {}
		}
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO effect VALUES ($1, 'x')`, msg.UUID)
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	runCtx, cancel := context.WithCancel(ctx)
	go func() { _ = r.Run(runCtx) }()
	<-r.Running()
	want := os.Getenv("IDEMPOTENCY_JOINED_CHILD_EXPECT")
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		if pool.QueryRow(ctx, `SELECT count(*)::text FROM effect`).Scan(new(string)) == nil {
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM effect`).Scan(&n)
			if fmt.Sprint(n) == strings.TrimSpace(want) {
				time.Sleep(500 * time.Millisecond)
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	_ = r.Close()
	return 0
}
